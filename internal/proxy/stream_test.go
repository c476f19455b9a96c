package proxy

import (
	"bytes"
	"strings"
	"testing"

	"github.com/compactproxy/compactproxy/internal/anchor"
)

// doneWatcher fails the test if [DONE] is written before usage was
// reported: the anchor must exist before the client can see the end.
type doneWatcher struct {
	t        *testing.T
	reported *bool
	out      bytes.Buffer
	sawDone  bool
}

func (d *doneWatcher) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte("[DONE]")) {
		d.sawDone = true
		if !*d.reported {
			d.t.Error("[DONE] written before the usage was reported")
		}
	}
	return d.out.Write(p)
}

func TestUsageReportedBeforeDone(t *testing.T) {
	cases := []struct {
		name      string
		stream    string
		hide      bool
		wantInput int
		visible   []string // must reach the client
		hidden    []string // must not
	}{
		{"hidden usage-only chunk", "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: " + usageChunk + "\n\ndata: [DONE]\n\n",
			true, 50, []string{`"content":"a"`, "[DONE]"}, []string{`"usage"`}},
		{"client asked for usage", "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: " + usageChunk + "\n\ndata: [DONE]\n\n",
			false, 50, []string{`"usage"`, "[DONE]"}, nil},
		{"llama.cpp timings in the last chunk", "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}],\"timings\":{\"prompt_n\":7,\"cache_n\":93,\"predicted_n\":3}}\n\ndata: [DONE]\n\n",
			true, 100, []string{`"timings"`, "[DONE]"}, nil},
		{"comment lines and CRLF", ": ping\r\n\r\ndata: " + usageChunk + "\r\n\r\ndata: [DONE]\r\n\r\n",
			false, 50, []string{": ping", "[DONE]"}, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			reported := false
			got := 0
			w := &doneWatcher{t: t, reported: &reported}
			err := relayEvents(w, strings.NewReader(tc.stream), tc.hide, func(u anchor.Usage) {
				reported = true
				got = u.Input
			})
			if err != nil {
				t.Fatal(err)
			}
			if !w.sawDone || got != tc.wantInput {
				t.Fatalf("done %v, input %d want %d", w.sawDone, got, tc.wantInput)
			}
			for _, v := range tc.visible {
				if !strings.Contains(w.out.String(), v) {
					t.Errorf("client did not get %q: %q", v, w.out.String())
				}
			}
			for _, h := range tc.hidden {
				if strings.Contains(w.out.String(), h) {
					t.Errorf("client got %q: %q", h, w.out.String())
				}
			}
		})
	}
}
