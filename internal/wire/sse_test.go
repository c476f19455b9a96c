package wire

import (
	"encoding/json"
	"testing"
)

func TestCutTopLevelKey(t *testing.T) {
	cases := []struct{ in, want string }{
		{`{"usage":{"a":1},"id":"x"}`, `{"id":"x"}`},
		{`{"id":"x","usage":{"a":1}}`, `{"id":"x"}`},
		{`{"id":"x","usage":null,"n":2}`, `{"id":"x","n":2}`},
		{`{ "id" : "x" , "usage" : { "a" : [1,2] } , "n" : 2 }`, `{ "id" : "x" , "n" : 2 }`},
		{`{"usage":1}`, `{}`},
		{`{"id":"usage","choices":[{"usage":1}],"usage":{}}`, `{"id":"usage","choices":[{"usage":1}]}`},
	}
	for _, tc := range cases {
		got, ok := CutTopLevelKey([]byte(tc.in), "usage")
		if !ok || string(got) != tc.want {
			t.Errorf("cut(%s) = %s, %v; want %s", tc.in, got, ok, tc.want)
		}
		var v any
		if json.Unmarshal(got, &v) != nil {
			t.Errorf("cut(%s) is not JSON: %s", tc.in, got)
		}
	}
	for _, in := range []string{`{"id":"x"}`, `[1]`, `{"id":`, `{"choices":[{"usage":1}]}`} {
		if got, ok := CutTopLevelKey([]byte(in), "usage"); ok {
			t.Errorf("cut(%s) = %s, want no cut", in, got)
		}
	}
}
