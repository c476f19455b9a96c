package main

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/compactproxy/compactproxy/internal/config"
	"github.com/go-viper/mapstructure/v2"
)

// envSetting is the config key a COMPACTPROXY_* variable sets and the Go
// type its value is decoded into.
type envSetting struct {
	key string
	typ reflect.Type
}

// envSettings maps every COMPACTPROXY_* name to its key, from config.Config's
// mapstructure tags (the walk registerDefaults does).
func envSettings() map[string]envSetting {
	out := map[string]envSetting{}
	var walk func(prefix string, t reflect.Type)
	walk = func(prefix string, t reflect.Type) {
		for i := range t.NumField() {
			f := t.Field(i)
			tag, _, _ := strings.Cut(f.Tag.Get("mapstructure"), ",")
			key := tag
			if prefix != "" {
				key = prefix + "." + tag
			}
			if f.Type.Kind() == reflect.Struct && f.Type != reflect.TypeFor[time.Duration]() {
				walk(key, f.Type)
				continue
			}
			out[envName(key)] = envSetting{key: key, typ: f.Type}
		}
	}
	walk("", reflect.TypeFor[config.Config]())
	return out
}

// envName is the variable that sets key: upstream.url → COMPACTPROXY_UPSTREAM_URL.
func envName(key string) string {
	return envPrefix + "_" + strings.ToUpper(strings.ReplaceAll(key, ".", "_"))
}

// checkEnv reports, as one *config.ValidationError, every COMPACTPROXY_*
// variable in environ that names no setting (a misspelt variable would
// otherwise be ignored silently, unlike a misspelt file key) and every value
// that does not parse as its setting's type, naming the variable and value.
// Empty values are skipped as loading skips them; secret values are never
// echoed.
func checkEnv(environ []string) error {
	settings := envSettings()
	var problems []config.FieldError
	for _, kv := range environ {
		name, val, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(name, envPrefix+"_") {
			continue
		}
		st, ok := settings[name]
		if !ok {
			msg := "not a setting: no config key has this name"
			if near := nearestEnvName(name, settings); near != "" {
				msg += "; did you mean " + near + "?"
			}
			problems = append(problems, config.FieldError{Key: name, Msg: msg})
			continue
		}
		if val == "" {
			continue
		}
		if err := decodeEnv(val, st.typ); err != nil {
			shown := fmt.Sprintf("%s=%q", name, val)
			if isSecret(st.typ) {
				shown = name
			}
			problems = append(problems, config.FieldError{Key: shown, Msg: wantText(st.typ) + " (" + st.key + ")"})
		}
	}
	if len(problems) == 0 {
		return nil
	}
	slices.SortFunc(problems, func(a, b config.FieldError) int { return strings.Compare(a.Key, b.Key) })
	return &config.ValidationError{Problems: problems}
}

// decodeEnv decodes val into a value of typ as loading does (viper's weakly
// typed decoding with the same hooks).
func decodeEnv(val string, typ reflect.Type) error {
	out := reflect.New(typ)
	dec, err := mapstructure.NewDecoder(&mapstructure.DecoderConfig{
		DecodeHook:       decodeHook(),
		WeaklyTypedInput: true,
		Result:           out.Interface(),
	})
	if err != nil {
		return err
	}
	return dec.Decode(val)
}

func isSecret(typ reflect.Type) bool {
	return typ == reflect.TypeFor[config.Secret]() || typ == reflect.TypeFor[[]config.Secret]()
}

// wantText says what a value of typ must look like.
func wantText(typ reflect.Type) string {
	switch {
	case typ == reflect.TypeFor[time.Duration]():
		return "want a duration such as 200ms, 30s or 5m"
	case typ == modelsType:
		return `want a JSON array of {"name","context_window"}`
	}
	switch typ.Kind() {
	case reflect.Int, reflect.Int64:
		return "want a whole number"
	case reflect.Float64:
		return "want a number such as 0.8"
	case reflect.Bool:
		return "want true or false"
	case reflect.Slice:
		return "want a comma-separated list"
	}
	return "cannot be read"
}

// nearestEnvName is the setting's variable closest to name by edit
// distance, if close enough to be a likely misspelling.
func nearestEnvName(name string, settings map[string]envSetting) string {
	best, bestD := "", 4
	for cand := range settings {
		if d := editDistance(name, cand); d < bestD || (d == bestD && cand < best) {
			best, bestD = cand, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance of a and b (bytes; the names are
// ASCII).
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
