// Package redisurl parses store.redis.url: which Redis deployment the
// proxy's state lives in (a single node, a Sentinel-managed master, or a
// Cluster) and how to reach it. It is standard library only, so config
// validation and the store read the same syntax.
//
// The forms (docs/configuration.md):
//
//	redis://[[user]:password@]host[:port][/db][?option=value...]
//	rediss://...                             (TLS)
//	redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/master[/db][?sentinel_username=u&sentinel_password=p]
//	rediss+sentinel://...                    (TLS, to the sentinels and to Redis)
//	redis+cluster://[[user]:password@]host[:port][,host[:port]...][/0]
//	rediss+cluster://...                     (TLS)
//
// A sentinel's default port is 26379, a Redis node's 6379. IPv6 hosts go
// in brackets. Reserved characters in a user, password, master name or
// query value (@ : / ? # % , + and space) are percent-encoded.
//
// Errors are fixed texts: they never quote the URL, whose userinfo and
// query may carry a password.
package redisurl

import (
	"errors"
	"net"
	"net/url"
	"strconv"
	"strings"
)

// Mode is the kind of deployment a URL names.
type Mode int

// The deployments.
const (
	Single   Mode = iota // one node: redis:// or rediss://
	Sentinel             // a master found through Sentinel: redis+sentinel://
	Cluster              // Redis Cluster: redis+cluster://
)

// String names the mode as the URL scheme does.
func (m Mode) String() string {
	switch m {
	case Sentinel:
		return "sentinel"
	case Cluster:
		return "cluster"
	}
	return "single"
}

// URL is a parsed store.redis.url. For Single, Raw is what go-redis'
// own ParseURL reads (its query options included); the other fields are
// set for Sentinel and Cluster only.
type URL struct {
	Mode Mode
	Raw  string
	TLS  bool
	// Addrs are the sentinels (Sentinel) or the seed nodes (Cluster), as
	// host:port.
	Addrs    []string
	Username string
	Password string
	// Master is the name the sentinels monitor (Sentinel).
	Master string
	DB     int
	// SentinelUsername and SentinelPassword authenticate to the sentinels
	// themselves (Sentinel; empty: no AUTH to them).
	SentinelUsername string
	SentinelPassword string
}

// Errors, fixed texts (config validation prefixes the key).
var (
	ErrMalformed    = errors.New("is not a valid URL")
	ErrScheme       = errors.New("must be redis://[[user]:password@]host[:port][/db], redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/master[/db] or redis+cluster://[[user]:password@]host[:port][,host[:port]...] (rediss, rediss+sentinel, rediss+cluster for TLS)")
	ErrHost         = errors.New("names no host")
	ErrSeveralHosts = errors.New("lists several hosts: redis:// is one node; use redis+sentinel:// or redis+cluster://")
	ErrHostList     = errors.New("has an empty or malformed host in its host list (host[:port],host[:port]...; IPv6 in brackets)")
	ErrPort         = errors.New("has a port that is not a number from 1 to 65535")
	ErrEscape       = errors.New("has a malformed percent-escape")
	ErrMaster       = errors.New("names no master: redis+sentinel://host[:port][,host[:port]...]/master[/db]")
	ErrDB           = errors.New("has a database that is not a number >= 0")
	ErrPath         = errors.New("has a path other than /master[/db] (sentinel) or /0 (cluster)")
	ErrClusterDB    = errors.New("names a database other than 0: a Redis Cluster has database 0 only")
	ErrQuery        = errors.New("has a query parameter other than sentinel_username or sentinel_password")
	ErrClusterQuery = errors.New("has a query: redis+cluster:// takes none")
	ErrFragment     = errors.New("has a #fragment")
)

// Parse reads store.redis.url.
func Parse(raw string) (URL, error) {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return URL{}, ErrScheme
	}
	u := URL{Raw: raw}
	switch strings.ToLower(scheme) {
	case "redis", "rediss":
		// go-redis' ParseURL reads the rest; this only checks the shape,
		// as validation always has.
		p, err := url.Parse(raw)
		if err != nil {
			return URL{}, ErrMalformed
		}
		if p.Host == "" {
			return URL{}, ErrHost
		}
		if strings.Contains(p.Host, ",") {
			return URL{}, ErrSeveralHosts
		}
		u.TLS = p.Scheme == "rediss"
		return u, nil
	case "redis+sentinel":
		u.Mode = Sentinel
	case "rediss+sentinel":
		u.Mode, u.TLS = Sentinel, true
	case "redis+cluster":
		u.Mode = Cluster
	case "rediss+cluster":
		u.Mode, u.TLS = Cluster, true
	default:
		return URL{}, ErrScheme
	}
	if strings.Contains(rest, "#") {
		return URL{}, ErrFragment
	}
	rest, query, _ := strings.Cut(rest, "?")
	authority, path, _ := strings.Cut(rest, "/")
	if at := strings.LastIndex(authority, "@"); at >= 0 {
		info := authority[:at]
		authority = authority[at+1:]
		user, pass, hasPass := strings.Cut(info, ":")
		var err error
		if u.Username, err = url.PathUnescape(user); err != nil {
			return URL{}, ErrEscape
		}
		if hasPass {
			if u.Password, err = url.PathUnescape(pass); err != nil {
				return URL{}, ErrEscape
			}
		}
	}
	defPort := "6379"
	if u.Mode == Sentinel {
		defPort = "26379"
	}
	addrs, err := hosts(authority, defPort)
	if err != nil {
		return URL{}, err
	}
	u.Addrs = addrs
	segs := []string{}
	if path != "" {
		segs = strings.Split(path, "/")
	}
	if u.Mode == Sentinel {
		if len(segs) == 0 || segs[0] == "" {
			return URL{}, ErrMaster
		}
		if u.Master, err = url.PathUnescape(segs[0]); err != nil {
			return URL{}, ErrEscape
		}
		if strings.TrimSpace(u.Master) == "" {
			return URL{}, ErrMaster
		}
		segs = segs[1:]
	}
	switch {
	case len(segs) > 1, len(segs) == 1 && segs[0] == "" && u.Mode == Sentinel:
		return URL{}, ErrPath
	case len(segs) == 1 && segs[0] != "":
		db, err := strconv.Atoi(segs[0])
		if err != nil || db < 0 {
			return URL{}, ErrDB
		}
		if u.Mode == Cluster && db != 0 {
			return URL{}, ErrClusterDB
		}
		u.DB = db
	}
	if query != "" {
		if u.Mode == Cluster {
			return URL{}, ErrClusterQuery
		}
		q, err := url.ParseQuery(query)
		if err != nil {
			return URL{}, ErrEscape
		}
		for k, v := range q {
			switch k {
			case "sentinel_username":
				u.SentinelUsername = v[len(v)-1]
			case "sentinel_password":
				u.SentinelPassword = v[len(v)-1]
			default:
				return URL{}, ErrQuery
			}
		}
	}
	return u, nil
}

// hosts splits a comma-separated host list into host:port addresses.
func hosts(list, defPort string) ([]string, error) {
	if list == "" {
		return nil, ErrHost
	}
	var out []string
	for h := range strings.SplitSeq(list, ",") {
		host, port := h, ""
		switch {
		case strings.HasPrefix(h, "["):
			end := strings.Index(h, "]")
			if end < 0 {
				return nil, ErrHostList
			}
			host = h[1:end]
			switch tail := h[end+1:]; {
			case tail == "":
			case strings.HasPrefix(tail, ":"):
				port = tail[1:]
				if port == "" {
					return nil, ErrPort
				}
			default:
				return nil, ErrHostList
			}
			if net.ParseIP(host) == nil {
				return nil, ErrHostList
			}
		case strings.Count(h, ":") > 1:
			return nil, ErrHostList // an IPv6 address without brackets
		case strings.Contains(h, ":"):
			host, port, _ = strings.Cut(h, ":")
			if port == "" {
				return nil, ErrPort
			}
		}
		if host == "" || strings.ContainsAny(host, " \t\r\n%@/[]") {
			return nil, ErrHostList
		}
		if port == "" {
			port = defPort
		}
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 || port[0] == '+' {
			return nil, ErrPort
		}
		out = append(out, net.JoinHostPort(host, port))
	}
	return out, nil
}
