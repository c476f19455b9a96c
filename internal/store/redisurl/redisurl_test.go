package redisurl

import (
	"errors"
	"net"
	"reflect"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want URL
	}{
		{"redis://:pw@10.0.0.1:6379/2", URL{Mode: Single}},
		{"rediss://cache.internal", URL{Mode: Single, TLS: true}},
		{"redis+sentinel://s1,s2:26380,[::1]:26381/mymaster", URL{Mode: Sentinel,
			Addrs: []string{"s1:26379", "s2:26380", "[::1]:26381"}, Master: "mymaster"}},
		{"redis+sentinel://app:p%40ss%3Aw%2Frd@s1:26379/my%20master/3?sentinel_password=s%2Bp&sentinel_username=sen", URL{Mode: Sentinel,
			Addrs: []string{"s1:26379"}, Username: "app", Password: "p@ss:w/rd", Master: "my master", DB: 3,
			SentinelUsername: "sen", SentinelPassword: "s+p"}},
		{"rediss+sentinel://:secret@s1/m/0", URL{Mode: Sentinel, TLS: true, Addrs: []string{"s1:26379"}, Password: "secret", Master: "m"}},
		{"redis+cluster://n1:7000,n2:7001,n3", URL{Mode: Cluster, Addrs: []string{"n1:7000", "n2:7001", "n3:6379"}}},
		{"rediss+cluster://:pw@n1:7000/0", URL{Mode: Cluster, TLS: true, Addrs: []string{"n1:7000"}, Password: "pw"}},
		{"REDIS+CLUSTER://n1:7000/", URL{Mode: Cluster, Addrs: []string{"n1:7000"}}},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := Parse(tc.in)
			if err != nil {
				t.Fatal(err)
			}
			tc.want.Raw = tc.in
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got  %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want error
	}{
		{"", ErrScheme},
		{"localhost:6379", ErrScheme},
		{"http://:hunter2@h:6379", ErrScheme},
		{"redis+sentinels://h/m", ErrScheme},
		{"redis://", ErrHost},
		{"redis://:hunter2@n1:7000,n2:7001/0", ErrSeveralHosts},
		{"redis://:hunter2@h:6379/0%zz", ErrMalformed},
		{"redis+sentinel://:hunter2@s1:26379", ErrMaster},
		{"redis+sentinel://:hunter2@s1:26379/", ErrMaster},
		{"redis+sentinel://s1//0", ErrMaster},
		{"redis+sentinel://:hunter2@s1,,s2/m", ErrHostList},
		{"redis+sentinel://:hunter2@/m", ErrHost},
		{"redis+sentinel://:hunter2@s1:0/m", ErrPort},
		{"redis+sentinel://:hunter2@s1:99999/m", ErrPort},
		{"redis+sentinel://:hunter2@s1:/m", ErrPort},
		{"redis+sentinel://:hunter2@s1:x/m", ErrPort},
		{"redis+sentinel://:hunter2@::1/m", ErrHostList},
		{"redis+sentinel://:hunter2@[::1/m", ErrHostList},
		{"redis+sentinel://:hunter2@[not-ip]:1/m", ErrHostList},
		{"redis+sentinel://:hunter2@s1/m/-1", ErrDB},
		{"redis+sentinel://:hunter2@s1/m/x", ErrDB},
		{"redis+sentinel://:hunter2@s1/m/0/extra", ErrPath},
		{"redis+sentinel://:hunter2@s1/m?password=hunter2", ErrQuery},
		{"redis+sentinel://:hunter2%zz@s1/m", ErrEscape},
		{"redis+sentinel://:hunter2@s1/m#frag", ErrFragment},
		{"redis+cluster://:hunter2@n1:7000/1", ErrClusterDB},
		{"redis+cluster://:hunter2@n1:7000/0/1", ErrPath},
		{"redis+cluster://:hunter2@n1:7000?read_only=1", ErrClusterQuery},
	} {
		t.Run(tc.in, func(t *testing.T) {
			_, err := Parse(tc.in)
			if !errors.Is(err, tc.want) {
				t.Fatalf("Parse: %v, want %v", err, tc.want)
			}
			if strings.Contains(err.Error(), "hunter2") {
				t.Fatalf("the error quotes the password: %v", err)
			}
		})
	}
}

var fixed = []error{ErrMalformed, ErrScheme, ErrHost, ErrSeveralHosts, ErrHostList, ErrPort, ErrEscape, ErrMaster,
	ErrDB, ErrPath, ErrClusterDB, ErrQuery, ErrClusterQuery, ErrFragment}

// FuzzParse: never a panic, only the fixed errors (never one that quotes
// the input), and
// every address of an accepted Sentinel or Cluster URL is host:port.
func FuzzParse(f *testing.F) {
	for _, s := range []string{"redis://:pw@h:1/0", "redis+sentinel://u:p@a,b:2,[::1]:3/m/1?sentinel_password=x",
		"rediss+cluster://a:1,b:2/0", "redis+cluster://[fe80::1]:7000"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		u, err := Parse(s)
		if err != nil {
			for _, e := range fixed {
				if err == e {
					return
				}
			}
			t.Fatalf("not one of the fixed errors: %v", err)
		}
		if u.Mode == Single {
			return
		}
		if len(u.Addrs) == 0 {
			t.Fatal("accepted with no address")
		}
		for _, a := range u.Addrs {
			if h, p, err := net.SplitHostPort(a); err != nil || h == "" || p == "" {
				t.Fatalf("address %q is not host:port", a)
			}
		}
		if u.Mode == Sentinel && u.Master == "" {
			t.Fatal("sentinel URL accepted without a master")
		}
	})
}
