// Command soak is the soak test's client (`make soak`, bench/soak.sh; not
// part of `make test`). In one run it sends the same load to the mock
// upstream directly, then through compactproxy twice (a shorter rehearsal,
// then the measured phase):
//
//   - -streams concurrent streaming clients for -duration (-rehearsal for
//     the rehearsal), each stream 5–20 s of events (the mock's
//     X-Mock-Stream-Duration), a share (-leave) of them leaving mid-stream
//     on purpose;
//   - a steady trickle of 1 MiB non-stream requests (-trickle apart).
//
// It checks every request was answered or aborted correctly, and reports
// the counts, compactproxy's goroutines (its go_goroutines metric), heap
// and RSS (/proc/PID/status) cold, after a light warm-up (start_light),
// after the rehearsal (start), at peak and at the end (after the run
// drained), and p50/p99 time to first byte of each phase, proxied against
// direct.
//
// Why a rehearsal: the Go runtime keeps what a peak made it grow — the
// descriptor of every goroutine that ever ran, a heap goal and metadata
// sized by the peak — so the first full load leaves the process bigger
// than a light warm-up did, leak or not. A leak is memory that grows with
// the traffic served, so the verdict compares two runs of the same load:
// the end of the measured phase against the start taken after the
// rehearsal. The end is also given against start_light and cold.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

type counts struct {
	Started, Completed, LeftOnPurpose, Failed atomic.Int64
	Big, BigOK, BigFailed                     atomic.Int64
}

type phase struct {
	Name          string   `json:"name"`
	Streams       int64    `json:"streams"`
	Completed     int64    `json:"completed"`
	LeftOnPurpose int64    `json:"left_on_purpose"`
	Failed        int64    `json:"failed"`
	Big           int64    `json:"big_requests"`
	BigOK         int64    `json:"big_ok"`
	BigFailed     int64    `json:"big_failed"`
	TTFBp50       float64  `json:"ttfb_p50_ms"`
	TTFBp99       float64  `json:"ttfb_p99_ms"`
	FirstFailures []string `json:"first_failures,omitempty"`
}

type sample struct {
	Goroutines int   `json:"goroutines"`
	RSSKiB     int64 `json:"rss_kib"`
	// RSS split (/proc/PID/status): anonymous memory (heap, stacks, runtime
	// metadata) and file-backed pages (the binary's code and data, mapped
	// as they are first touched: a proxy that served nothing yet has fewer).
	RSSAnonKiB int64 `json:"rss_anon_kib"`
	RSSFileKiB int64 `json:"rss_file_kib"`
	// HeapInuseKiB (go_memstats_heap_inuse_bytes) and HeapAllocKiB
	// (go_memstats_heap_alloc_bytes: live objects plus garbage not yet
	// collected) tell what the process holds from memory the runtime has
	// not yet returned to the OS.
	HeapInuseKiB int64 `json:"heap_inuse_kib"`
	HeapAllocKiB int64 `json:"heap_alloc_kib"`
	// GCs is go_gc_duration_seconds_count: collections so far.
	GCs int64 `json:"gcs"`
}

func (s sample) String() string {
	return fmt.Sprintf("%d goroutines, %d KiB RSS (%d anon, %d file), %d KiB heap in use, %d KiB heap allocated, %d GCs",
		s.Goroutines, s.RSSKiB, s.RSSAnonKiB, s.RSSFileKiB, s.HeapInuseKiB, s.HeapAllocKiB, s.GCs)
}

func main() {
	direct := flag.String("direct", "", "mock upstream base URL incl. /v1")
	proxy := flag.String("proxy", "", "compactproxy base URL incl. /v1")
	metricsURL := flag.String("metrics", "", "compactproxy /metrics URL")
	pid := flag.Int("pid", 0, "compactproxy's pid (RSS)")
	streams := flag.Int("streams", 1000, "concurrent streaming clients")
	duration := flag.Duration("duration", 60*time.Second, "how long streams are started, in the direct and the measured phase")
	rehearsal := flag.Duration("rehearsal", 20*time.Second, "how long streams are started in the rehearsal through the proxy before the start sample (the same load otherwise)")
	trickle := flag.Duration("trickle", 250*time.Millisecond, "time between 1 MiB non-stream requests")
	leave := flag.Float64("leave", 0.1, "share of streams whose client leaves mid-stream")
	drain := flag.Duration("drain", 300*time.Second, "how long to wait for the proxy to settle after the rehearsal and after the measured phase (RSS falls after the pools' 10 s idle time, a collection (an idle Go process collects every 2 min) and the scavenger)")
	warm := flag.Duration("warm-settle", 240*time.Second, "after the light warm-up, how long to wait at most for the proxy to settle before the start_light sample")
	out := flag.String("out", "", "write the JSON report here too")
	flag.Parse()

	big := bigBody()
	report := struct {
		Phases []phase `json:"phases"`
		// Cold: the proxy before it served any chat request. StartLight:
		// after a light warm-up through it (8 streams and four 1 MiB
		// requests), settled as the end is. Start: after the rehearsal
		// (the full load for -rehearsal), settled as the end is; the
		// runtime's high-water figures (goroutine descriptors, heap goal
		// and metadata sized by a peak) are then in both the start and
		// the end, so the verdict compares the end with Start and gives
		// StartLight and Cold alongside.
		Cold          sample `json:"cold_start"`
		StartLight    sample `json:"start_light"`
		RehearsalPeak sample `json:"rehearsal_peak"`
		Start         sample `json:"start"`
		Peak          sample `json:"peak"`
		End           sample `json:"end"`
		// How long each sample waited to settle.
		StartLightSettle string `json:"start_light_settled_after"`
		StartSettle      string `json:"start_settled_after"`
		Drain            string `json:"drained_after"`
		// The proxy every 30 s while settling after the rehearsal and
		// while draining after the measured phase.
		RehearsalDrainSamples []string `json:"rehearsal_drain_samples"`
		DrainSamples          []string `json:"drain_samples"`
		Verdict               []string `json:"verdict"`
	}{}

	d := runPhase("direct", *direct, *streams, *duration, *trickle, *leave, big)
	report.Phases = append(report.Phases, d)

	report.Cold = measure(*metricsURL, *pid)
	warmUp(*proxy, big)
	var settled bool
	report.StartLight, settled, report.StartLightSettle = settle(*metricsURL, *pid, *warm, report.Cold.Goroutines, nil)
	if !settled {
		report.Verdict = append(report.Verdict, fmt.Sprintf("the light warm-up had not settled after %s: the start_light figures are the last sample", report.StartLightSettle))
	}

	stopPeak := watchPeak(*metricsURL, *pid, report.StartLight)
	r := runPhase("rehearsal", *proxy, *streams, *rehearsal, *trickle, *leave, big)
	report.RehearsalPeak = stopPeak()
	report.Phases = append(report.Phases, r)
	report.Start, settled, report.StartSettle = settle(*metricsURL, *pid, *drain, report.StartLight.Goroutines, func(el time.Duration, s sample) {
		report.RehearsalDrainSamples = append(report.RehearsalDrainSamples, fmt.Sprintf("%s: %s", el.Round(time.Second), s))
	})
	if !settled {
		report.Verdict = append(report.Verdict, fmt.Sprintf("the proxy had not settled after %s after the rehearsal: the start figures are the last sample", report.StartSettle))
	}

	stopPeak = watchPeak(*metricsURL, *pid, report.Start)
	p := runPhase("compactproxy", *proxy, *streams, *duration, *trickle, *leave, big)
	report.Peak = stopPeak()
	report.Phases = append(report.Phases, p)

	// Drain: the clients' idle connections are closed by runPhase; the
	// mock closes the proxy's idle upstream connections (-idle-timeout).
	report.End, settled, report.Drain = settle(*metricsURL, *pid, *drain, report.Start.Goroutines, func(el time.Duration, s sample) {
		report.DrainSamples = append(report.DrainSamples, fmt.Sprintf("%s: %s", el.Round(time.Second), s))
	})
	start, end := report.Start, report.End
	if !settled {
		report.Verdict = append(report.Verdict, fmt.Sprintf("the proxy had not settled after %s of draining (two collections after its pools' idle time, RSS flat for 30 s, goroutines back to the start's): the end figures are the last sample", report.Drain))
	}

	// The exit status counts failed requests, goroutines that did not
	// settle and RSS that grew by more than 10% from the start (after the
	// rehearsal) to the end: with the runtime's high-water figures in
	// both, growth is what the measured run left behind. Heap in use is
	// the cheap second look at the same question (live objects, no
	// runtime retention of freed pages); it is reported, not counted, as
	// its few megabytes move by more than 10% with a collection's timing.
	ok := true
	for _, ph := range report.Phases {
		if ph.Failed > 0 || ph.BigFailed > 0 {
			ok = false
			report.Verdict = append(report.Verdict, fmt.Sprintf("%s: %d streams and %d big requests not answered or aborted correctly", ph.Name, ph.Failed, ph.BigFailed))
		}
	}
	if !goroutinesBack(end.Goroutines, start.Goroutines) {
		ok = false
		report.Verdict = append(report.Verdict, fmt.Sprintf("goroutines did not settle: %d at start, %d at end", start.Goroutines, end.Goroutines))
	} else {
		report.Verdict = append(report.Verdict, fmt.Sprintf("goroutines %d at start, %d at end", start.Goroutines, end.Goroutines))
	}
	ratio := func(a, b int64) float64 { return float64(a) / float64(b) }
	if float64(end.RSSKiB) > 1.1*float64(start.RSSKiB) {
		ok = false
		report.Verdict = append(report.Verdict, fmt.Sprintf("not flat: RSS at end %d KiB is more than 10%% over start %d KiB (after the rehearsal) after %s of draining (%.2fx)", end.RSSKiB, start.RSSKiB, report.Drain, ratio(end.RSSKiB, start.RSSKiB)))
	} else {
		report.Verdict = append(report.Verdict, fmt.Sprintf("flat: RSS at end %d KiB is within 10%% of start %d KiB (after the rehearsal) after %s of draining (%.2fx)", end.RSSKiB, start.RSSKiB, report.Drain, ratio(end.RSSKiB, start.RSSKiB)))
	}
	report.Verdict = append(report.Verdict,
		fmt.Sprintf("heap in use %d KiB at start, %d KiB at end (%.2fx)", start.HeapInuseKiB, end.HeapInuseKiB, ratio(end.HeapInuseKiB, start.HeapInuseKiB)),
		fmt.Sprintf("against start_light (%d KiB, after the light warm-up, before any full load) the end RSS is %.2fx", report.StartLight.RSSKiB, ratio(end.RSSKiB, report.StartLight.RSSKiB)),
		fmt.Sprintf("against the cold start (%d KiB, %d KiB anon, %d KiB file, before any chat request) the end RSS is %.2fx",
			report.Cold.RSSKiB, report.Cold.RSSAnonKiB, report.Cold.RSSFileKiB, ratio(end.RSSKiB, report.Cold.RSSKiB)))
	b, _ := json.MarshalIndent(report, "", "  ")
	fmt.Println(string(b))
	fmt.Println()
	for _, v := range report.Verdict {
		fmt.Println(v)
	}
	fmt.Printf("TTFB p50 %.1f ms / p99 %.1f ms through compactproxy vs %.1f / %.1f ms direct (ratio p50 %.2f, p99 %.2f)\n",
		p.TTFBp50, p.TTFBp99, d.TTFBp50, d.TTFBp99, p.TTFBp50/d.TTFBp50, p.TTFBp99/d.TTFBp99)
	if *out != "" {
		_ = os.WriteFile(*out, b, 0o644)
	}
	if !ok {
		os.Exit(1)
	}
}

// watchPeak samples the proxy every 500 ms until the returned function is
// called, which returns the highest of each figure (from base on).
func watchPeak(metricsURL string, pid int, base sample) func() sample {
	peak := base
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(500 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				s := measure(metricsURL, pid)
				peak.Goroutines = max(peak.Goroutines, s.Goroutines)
				peak.RSSKiB = max(peak.RSSKiB, s.RSSKiB)
				peak.HeapInuseKiB = max(peak.HeapInuseKiB, s.HeapInuseKiB)
				peak.RSSAnonKiB = max(peak.RSSAnonKiB, s.RSSAnonKiB)
				peak.RSSFileKiB = max(peak.RSSFileKiB, s.RSSFileKiB)
				peak.HeapAllocKiB = max(peak.HeapAllocKiB, s.HeapAllocKiB)
				peak.GCs = s.GCs
			}
		}
	})
	return func() sample {
		close(stop)
		wg.Wait()
		return peak
	}
}

// runPhase runs the load against base and waits for every request to end.
func runPhase(name, base string, streams int, duration, trickle time.Duration, leave float64, big []byte) phase {
	tr := &http.Transport{MaxIdleConns: streams + 64, MaxIdleConnsPerHost: streams + 64, IdleConnTimeout: 30 * time.Second}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	var c counts
	var mu sync.Mutex
	var ttfb []time.Duration
	var failures []string
	fail := func(format string, args ...any) {
		mu.Lock()
		if len(failures) < 10 {
			failures = append(failures, fmt.Sprintf(format, args...))
		}
		mu.Unlock()
	}
	deadline := time.Now().Add(duration)
	var wg sync.WaitGroup
	for i := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Spread the first requests over two seconds.
			time.Sleep(time.Duration(i) * 2 * time.Second / time.Duration(streams))
			for time.Now().Before(deadline) {
				c.Started.Add(1)
				d, leaveAfter := 5*time.Second+rand.N(15*time.Second), time.Duration(0)
				if rand.Float64() < leave {
					leaveAfter = time.Second + rand.N(3*time.Second)
				}
				t, err := oneStream(client, base, d, leaveAfter)
				switch {
				case errors.Is(err, errLeft):
					c.LeftOnPurpose.Add(1)
				case err != nil:
					c.Failed.Add(1)
					fail("stream: %v", err)
				default:
					c.Completed.Add(1)
				}
				if t > 0 {
					mu.Lock()
					ttfb = append(ttfb, t)
					mu.Unlock()
				}
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(trickle)
		defer t.Stop()
		var bwg sync.WaitGroup
		for time.Now().Before(deadline) {
			<-t.C
			bwg.Add(1)
			go func() {
				defer bwg.Done()
				c.Big.Add(1)
				if err := oneBig(client, base, big); err != nil {
					c.BigFailed.Add(1)
					fail("1 MiB request: %v", err)
					return
				}
				c.BigOK.Add(1)
			}()
		}
		bwg.Wait()
	}()
	wg.Wait()
	slices.Sort(ttfb)
	pct := func(q float64) float64 {
		if len(ttfb) == 0 {
			return 0
		}
		return float64(ttfb[min(len(ttfb)-1, int(q*float64(len(ttfb))))]) / float64(time.Millisecond)
	}
	return phase{Name: name, Streams: c.Started.Load(), Completed: c.Completed.Load(), LeftOnPurpose: c.LeftOnPurpose.Load(),
		Failed: c.Failed.Load(), Big: c.Big.Load(), BigOK: c.BigOK.Load(), BigFailed: c.BigFailed.Load(),
		TTFBp50: pct(0.50), TTFBp99: pct(0.99), FirstFailures: failures}
}

var errLeft = errors.New("left on purpose")

// oneStream sends one streaming request; the stream must end with
// [DONE] unless the client leaves (leaveAfter > 0). It returns the time to
// the first byte of the body.
func oneStream(client *http.Client, base string, d, leaveAfter time.Duration) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d+30*time.Second)
	defer cancel()
	body := `{"model":"bench-model","stream":true,"messages":[{"role":"user","content":"write a long answer"}]}`
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Mock-Stream-Duration", d.String())
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return 0, fmt.Errorf("status %d", resp.StatusCode)
	}
	br := bufio.NewReader(resp.Body)
	if _, err := br.Peek(1); err != nil {
		return 0, fmt.Errorf("no first byte: %w", err)
	}
	ttfb := time.Since(start)
	if leaveAfter > 0 {
		time.AfterFunc(leaveAfter, cancel)
	}
	var last []byte
	events := 0
	for {
		line, err := br.ReadBytes('\n')
		if len(bytes.TrimSpace(line)) > 0 {
			last = line
			events++
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			if leaveAfter > 0 && ctx.Err() != nil {
				return ttfb, errLeft
			}
			return ttfb, fmt.Errorf("after %d events: %w", events, err)
		}
	}
	if string(bytes.TrimSpace(last)) != "data: [DONE]" {
		return ttfb, fmt.Errorf("stream ended without [DONE] after %d events", events)
	}
	if leaveAfter > 0 && leaveAfter < d {
		return ttfb, errors.New("a stream outlived its client")
	}
	return ttfb, nil
}

func oneBig(client *http.Client, base string, body []byte) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/chat/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != 200 || !bytes.Contains(b, []byte(`"chat.completion"`)) {
		return fmt.Errorf("status %d: %.200s", resp.StatusCode, b)
	}
	return nil
}

// bigBody is a 1 MiB agent request: tool calls answered by long outputs.
func bigBody() []byte {
	var sb strings.Builder
	sb.WriteString(`{"model":"bench-model","messages":[{"role":"system","content":"You are a coding agent."},{"role":"user","content":"fix the tests"}`)
	out := strings.Repeat("a line of tool output that the model reads\\n", 370) // ~16 KiB
	for i := 0; sb.Len() < 1<<20; i++ {
		id := "call_" + strconv.Itoa(i)
		fmt.Fprintf(&sb, `,{"role":"assistant","content":null,"tool_calls":[{"id":%q,"type":"function","function":{"name":"run","arguments":"{}"}}]},{"role":"tool","tool_call_id":%q,"content":"%s"}`, id, id, out)
	}
	sb.WriteString(`]}`)
	return []byte(sb.String())
}

// goroutinesBack reports whether got goroutines are back to want: at most
// 10% more, and at least 4 more allowed. An idle proxy's count moves by
// a few between samples (the scrape's own connection, timers' goroutines:
// 8 one second, 10 the next), which is more than 10% of its ten or so; a
// leak from thousands of requests would be hundreds.
func goroutinesBack(got, want int) bool {
	return got <= want+max(want/10, 4)
}

// settle samples the proxy every second until it has settled, at most for
// max: its goroutines are back to want (goroutinesBack), two collections ran
// after its pools' idle time (the proxy's pools drop idle buffers after
// 10 s, a collection frees them, and net/http's own sync.Pools need two),
// and in the 30 s since the second one RSS did not fall by more than 1%
// (the scavenger, which returns the freed pages after a collection, is
// done). every, when set, gets a sample every 30 s and the last one.
func settle(metricsURL string, pid int, max time.Duration, want int, every func(time.Duration, sample)) (sample, bool, string) {
	const poolIdle, flat = 11 * time.Second, 30
	t0 := time.Now()
	var (
		s          sample
		gcBase     int64         = -1
		gcDone     time.Duration // when the second collection was seen
		window     []sample      // one sample a second, the last 30
		nextReport time.Duration
	)
	for {
		s = measure(metricsURL, pid)
		el := time.Since(t0)
		if every != nil && el >= nextReport {
			every(el, s)
			nextReport += 30 * time.Second
		}
		if gcBase < 0 && el >= poolIdle {
			gcBase = s.GCs
		}
		window = append(window, s)
		if len(window) > flat {
			window = window[1:]
		}
		if gcDone == 0 && gcBase >= 0 && s.GCs >= gcBase+2 {
			gcDone = el
		}
		rssFlat := len(window) == flat && float64(s.RSSKiB) >= 0.99*float64(window[0].RSSKiB)
		done := gcDone > 0 && el >= gcDone+flat*time.Second && rssFlat && goroutinesBack(s.Goroutines, want)
		if done || el >= max {
			if every != nil {
				every(el, s)
			}
			return s, done, el.Round(time.Second).String()
		}
		time.Sleep(time.Second)
	}
}

// warmUp sends a few streams (two leaving mid-stream) and 1 MiB requests
// through the proxy and waits for them.
func warmUp(base string, big []byte) {
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			leave := time.Duration(0)
			if i < 2 {
				leave = time.Second
			}
			_, _ = oneStream(client, base, 2*time.Second, leave)
		})
	}
	for range 4 {
		wg.Go(func() { _ = oneBig(client, base, big) })
	}
	wg.Wait()
}

// measure reads go_goroutines and heap figures from /metrics and the RSS of
// pid. The scrape asks for an uncompressed answer: a gzip writer is a
// megabyte of the proxy's heap that only the measuring would cause.
func measure(metricsURL string, pid int) sample {
	var s sample
	req, _ := http.NewRequest(http.MethodGet, metricsURL, nil)
	req.Header.Set("Accept-Encoding", "identity")
	if resp, err := http.DefaultClient.Do(req); err == nil {
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "go_goroutines "); ok {
				f, _ := strconv.ParseFloat(v, 64)
				s.Goroutines = int(f)
			}
			if v, ok := strings.CutPrefix(sc.Text(), "go_memstats_heap_inuse_bytes "); ok {
				f, _ := strconv.ParseFloat(v, 64)
				s.HeapInuseKiB = int64(f) / 1024
			}
			if v, ok := strings.CutPrefix(sc.Text(), "go_gc_duration_seconds_count "); ok {
				s.GCs, _ = strconv.ParseInt(v, 10, 64)
			}
			if v, ok := strings.CutPrefix(sc.Text(), "go_memstats_heap_alloc_bytes "); ok {
				f, _ := strconv.ParseFloat(v, 64)
				s.HeapAllocKiB = int64(f) / 1024
			}
		}
		resp.Body.Close()
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
		kib := func(v string) int64 {
			n, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return n
		}
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
				s.RSSKiB = kib(v)
			}
			if v, ok := strings.CutPrefix(l, "RssAnon:"); ok {
				s.RSSAnonKiB = kib(v)
			}
			if v, ok := strings.CutPrefix(l, "RssFile:"); ok {
				s.RSSFileKiB = kib(v)
			}
		}
	}
	return s
}
