package proxy

import (
	"net/http"

	"github.com/compactproxy/compactproxy/internal/upstream"
	"github.com/compactproxy/compactproxy/internal/wire"
)

// writeError answers status with OpenAI's JSON error envelope, the
// envelope of the proxy's own paths. param and code may be "" (encoded as
// null, as OpenAI does).
func writeError(w http.ResponseWriter, status int, typ, code, param, msg string) {
	writeBody(w, status, wire.OpenAIError(typ, code, param, msg))
}

// writeErrorIn answers in an API's own error envelope.
func writeErrorIn(api *wire.API, w http.ResponseWriter, status int, typ, code, param, msg string) {
	writeBody(w, status, api.ErrorBody(status, typ, code, param, msg))
}

func writeBody(w http.ResponseWriter, status int, body []byte) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Del("Content-Length")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

// writeUpstreamFailure answers the client for an upstream failure class.
func writeUpstreamFailure(w http.ResponseWriter, f upstream.Failure) {
	writeError(w, f.Status, "upstream_error", f.Code, "", "compactproxy: "+f.Text)
}
