package proxy

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/wire"
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
		{"usage riding on a content chunk", "data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":{\"prompt_tokens\":50,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n",
			true, 50, []string{`{"id":"c","choices":[{"delta":{"content":"a"}}]}`, "[DONE]"}, []string{`"usage"`, "prompt_tokens"}},
		{"usage null on every chunk, then usage-only", "data: {\"usage\":null,\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: " + usageChunk + "\n\ndata: [DONE]\n\n",
			true, 50, []string{`{"choices":[{"delta":{"content":"a"}}]}`, "[DONE]"}, []string{`"usage"`}},
		{"comment lines and CRLF", ": ping\r\n\r\ndata: " + usageChunk + "\r\n\r\ndata: [DONE]\r\n\r\n",
			false, 50, []string{": ping", "[DONE]"}, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			reported := false
			got := 0
			w := &doneWatcher{t: t, reported: &reported}
			err := relayEvents(w, strings.NewReader(tc.stream), wire.ChatCompletions.NewStream(tc.hide), func(u anchor.Usage) {
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

// Item 2 and the usage-only suspicion: a stream that ends without [DONE] or
// a finish reason is broken; a usage-only chunk without a choices key is
// not relayed to a client that did not ask for usage.
func TestRelayEventsEnds(t *testing.T) {
	cases := []struct {
		name    string
		stream  string
		hide    bool
		broken  bool
		visible []string
		hidden  []string
	}{
		{"content then EOF", "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"one\"}}]}\n\ndata: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"two\"}}]}\n\n",
			false, true, []string{"one", "two"}, nil},
		{"nothing then EOF", "", false, true, nil, nil},
		{"finish reason then EOF", "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
			false, false, nil, nil},
		{"[DONE]", "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"one\"}}]}\n\ndata: [DONE]\n\n",
			false, false, []string{"one", "[DONE]"}, nil},
		{"finish_reason null then EOF", "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"one\"},\"finish_reason\":null}]}\n\n",
			false, true, []string{"one"}, nil},
		{"usage-only chunk without choices, hidden", "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"one\"},\"finish_reason\":\"stop\"}]}\n\ndata: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"usage\":{\"prompt_tokens\":50,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n",
			true, false, []string{"one", "[DONE]"}, []string{`"id":"c","object"`, "usage"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			err := relayEvents(&out, strings.NewReader(tc.stream), wire.ChatCompletions.NewStream(tc.hide), func(anchor.Usage) {})
			var broken streamBroken
			if got := errors.As(err, &broken); got != tc.broken {
				t.Errorf("relayEvents = %v, want broken=%v", err, tc.broken)
			}
			for _, v := range tc.visible {
				if !strings.Contains(out.String(), v) {
					t.Errorf("client did not get %q: %q", v, out.String())
				}
			}
			for _, h := range tc.hidden {
				if strings.Contains(out.String(), h) {
					t.Errorf("client got %q: %q", h, out.String())
				}
			}
		})
	}
}
