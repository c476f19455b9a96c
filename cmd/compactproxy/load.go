package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"

	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/go-viper/mapstructure/v2"
	"github.com/spf13/pflag"
	"github.com/spf13/viper"
)

// envPrefix makes upstream.url read from COMPACTPROXY_UPSTREAM_URL.
const envPrefix = "COMPACTPROXY"

// defaultConfigFile is read when --config is not given and the file exists
// (relative to the working directory, so `make run` in a checkout picks up
// the commented defaults and a container, which has no such file, does not).
const defaultConfigFile = "configs/compactproxy.yaml"

// flagKeys maps each config flag to the key it sets. Flags win over every
// other source, but only when given on the command line (viper ignores an
// unchanged flag unless no other source, defaults included, has the key).
var flagKeys = map[string]string{
	"listen":       "listen",
	"upstream-url": "upstream.url",
	"log-level":    "log.level",
	"log-format":   "log.format",
}

// loadConfig builds the effective configuration from, in increasing
// precedence: defaults, the config file, COMPACTPROXY_* environment
// variables and the flags in fset (already parsed). defaultFile is read when
// --config is empty and it exists. It returns the file it read ("" = none).
// It does not validate: `config` and `healthcheck` work on an incomplete
// configuration too (serve and config check the environment first:
// checkEnv).
func loadConfig(fset *pflag.FlagSet, defaultFile string) (config.Config, string, error) {
	v := viper.New()

	// Every key gets its default registered: viper's AutomaticEnv only
	// answers for keys it already knows, so without this an env-only
	// setting (the container case) would never reach Unmarshal.
	registerDefaults(v, "", reflect.ValueOf(config.Default()))

	v.SetEnvPrefix(envPrefix)
	v.SetEnvKeyReplacer(strings.NewReplacer(".", "_"))
	v.AutomaticEnv()

	file, _ := fset.GetString("config")
	if file == "" && defaultFile != "" {
		if _, err := os.Stat(defaultFile); err == nil {
			file = defaultFile
		} else if !errors.Is(err, fs.ErrNotExist) {
			return config.Config{}, "", fmt.Errorf("config file %s: %w", defaultFile, err)
		}
	}
	if file != "" {
		v.SetConfigFile(file)
		if filepath.Ext(file) == "" {
			v.SetConfigType("yaml")
		}
		if err := v.ReadInConfig(); err != nil {
			return config.Config{}, file, fmt.Errorf("config file %s: %w", file, err)
		}
	}

	for name, key := range flagKeys {
		if f := fset.Lookup(name); f != nil {
			if err := v.BindPFlag(key, f); err != nil {
				return config.Config{}, file, fmt.Errorf("bind flag --%s: %w", name, err)
			}
		}
	}

	var cfg config.Config
	err := v.Unmarshal(&cfg, func(dc *mapstructure.DecoderConfig) {
		dc.DecodeHook = decodeHook()
		// A misspelt key in the file is an error, not a silently ignored
		// setting (env and flags only ever name known keys).
		dc.ErrorUnused = true
	})
	if err != nil {
		return config.Config{}, file, fmt.Errorf("config: %w", err)
	}
	return cfg, file, nil
}

// decodeHook turns strings (environment values) into the config's types.
func decodeHook() mapstructure.DecodeHookFunc {
	return mapstructure.ComposeDecodeHookFunc(
		modelsFromJSON,
		mapstructure.StringToTimeDurationHookFunc(),
		commaList,
	)
}

// registerDefaults walks a Config value by its mapstructure tags and sets
// every leaf (a non-struct field: scalars, durations, slices) as a default,
// so no key can be forgotten when a field is added to config.Config.
func registerDefaults(v *viper.Viper, prefix string, val reflect.Value) {
	t := val.Type()
	for i := range t.NumField() {
		f := t.Field(i)
		tag, _, _ := strings.Cut(f.Tag.Get("mapstructure"), ",")
		if tag == "" || tag == "-" {
			panic(fmt.Sprintf("config field %s.%s has no mapstructure tag", t.Name(), f.Name))
		}
		key := tag
		if prefix != "" {
			key = prefix + "." + tag
		}
		fv := val.Field(i)
		if fv.Kind() == reflect.Struct {
			registerDefaults(v, key, fv)
			continue
		}
		if fv.Kind() == reflect.Slice && fv.IsNil() {
			// A nil default would make the key unknown to viper (and so to
			// AutomaticEnv); an empty slice keeps it registered.
			fv = reflect.MakeSlice(fv.Type(), 0, 0)
		}
		v.SetDefault(key, fv.Interface())
	}
}

// commaList splits an environment string into a list of strings (or of a
// string type, like []config.Secret): COMPACTPROXY_AUTH_CLIENT_KEYS=a,b.
// mapstructure's own StringToSliceHookFunc only targets []string.
func commaList(from, to reflect.Type, data any) (any, error) {
	if from.Kind() != reflect.String || to.Kind() != reflect.Slice || to.Elem().Kind() != reflect.String {
		return data, nil
	}
	out := []string{}
	for item := range strings.SplitSeq(data.(string), ",") {
		if item = strings.TrimSpace(item); item != "" {
			out = append(out, item)
		}
	}
	return out, nil
}

var modelsType = reflect.TypeFor[[]config.Model]()

// modelsFromJSON lets `models` come from the environment as a JSON array:
// COMPACTPROXY_MODELS='[{"name":"qwen3","context_window":32768}]'.
func modelsFromJSON(from, to reflect.Type, data any) (any, error) {
	if from.Kind() != reflect.String || to != modelsType {
		return data, nil
	}
	s := strings.TrimSpace(data.(string))
	if s == "" {
		return []config.Model{}, nil
	}
	var raw []struct {
		Name          string `json:"name"`
		ContextWindow int    `json:"context_window"`
	}
	dec := json.NewDecoder(strings.NewReader(s))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&raw); err != nil {
		return nil, fmt.Errorf("models: want a JSON array of {\"name\",\"context_window\"}: %w", err)
	}
	out := make([]config.Model, len(raw))
	for i, m := range raw {
		out[i] = config.Model{Name: m.Name, ContextWindow: m.ContextWindow}
	}
	return out, nil
}
