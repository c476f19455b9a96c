package proxy

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"

	"github.com/compactproxy/compactproxy/internal/anchor"
	"github.com/compactproxy/compactproxy/internal/bufpool"
	"github.com/compactproxy/compactproxy/internal/wire"
)

// readerPool recycles the stream readers: one per streamed response would
// otherwise be an allocation per request. 16 KiB holds any ordinary event
// (longer lines are assembled by wire.ReadLine); at 64 KiB, the 1,000
// concurrent streams of make soak would hold 64 MiB in readers alone. An
// bufpool.Pool (one class): at most readerPoolBytes of idle readers
// (1,024), none after bufpool.Idle without a stream ending.
var readerPool = bufpool.New[*bufio.Reader](1, readerPoolBytes, bufpool.Idle)

const (
	streamReaderSize = 16 << 10
	readerPoolBytes  = 1024 * streamReaderSize
)

func isEventStream(ct string) bool {
	mt, _, err := mime.ParseMediaType(ct)
	return err == nil && mt == "text/event-stream"
}

var errClientGone = errors.New("proxy: client write failed")

// streamBroken wraps the read error of an upstream stream that ended without
// a clean end of body (a reset, a cut chunked encoding, a timeout).
type streamBroken struct{ error }

func (e streamBroken) Unwrap() error { return e.error }

// errEndedEarly is the upstream's stream ending on a clean EOF before its
// answer did: no [DONE] and no finish reason (a closed connection without a
// Content-Length or chunked terminator looks like a normal end to a
// reader). DESIGN: the client gets the error event and an aborted response.
// It wraps io.ErrUnexpectedEOF: classified as a closed connection.
var errEndedEarly = fmt.Errorf("proxy: upstream stream ended early: %w", io.ErrUnexpectedEOF)

// relayEvents copies an SSE stream to w, one flush per event, never
// coalescing events; sr (the API's wire.Stream) says what each event
// means. The usage it reads is reported through onUsage before the event
// that ends the stream is written, so the client's next request sees the
// anchor.
func relayEvents(w io.Writer, body io.Reader, sr wire.Stream, onUsage func(anchor.Usage)) error {
	br, ok := readerPool.Get(0)
	if !ok {
		br = bufio.NewReaderSize(nil, streamReaderSize)
	}
	br.Reset(body)
	defer func() { br.Reset(nil); readerPool.Put(0, br, streamReaderSize) }()
	flusher, _ := w.(http.Flusher)
	var (
		ev, long []byte
		last     anchor.Usage
		have     bool
		reported bool
		complete bool // the answer is complete: a clean EOF may follow
	)
	report := func() {
		if have && !reported {
			reported = true
			onUsage(last)
		}
	}
	emit := func(ev []byte) error {
		if len(ev) == 0 {
			return nil
		}
		st := sr.Event(ev)
		if st.HasUsage {
			last, have = st.Usage, true
		}
		if st.Report {
			report()
		}
		complete = complete || st.Complete
		if st.Relay == nil {
			return nil
		}
		if _, err := w.Write(st.Relay); err != nil {
			return errClientGone
		}
		if flusher != nil {
			flusher.Flush()
		}
		return nil
	}
	for {
		var line []byte
		var err error
		line, long, err = wire.ReadLine(br, long)
		if len(line) > 0 {
			ev = append(ev, line...)
			if wire.IsBlank(line) {
				if werr := emit(ev); werr != nil {
					return werr
				}
				ev = ev[:0]
			}
		}
		if err != nil {
			// End of stream, clean or not: relay what is left and report
			// usage if any arrived. A read error, or an EOF before the
			// answer was complete, is returned as streamBroken: the caller
			// must not end the client's stream as if it were complete
			// (CRAFT habit 15: any io.EOF is not a normal end).
			if werr := emit(ev); werr != nil {
				return werr
			}
			report()
			if err == io.EOF {
				if complete {
					return nil
				}
				return streamBroken{errEndedEarly}
			}
			return streamBroken{err}
		}
	}
}
