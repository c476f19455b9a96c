package upstream

import (
	"net/http"
	"strings"
)

// hopHeaders are not forwarded (RFC 9110 § 7.6.1), plus the ones the
// transport sets itself.
var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
	"Content-Length", "Host",
	// The transport negotiates compression itself and decodes it, so the
	// proxy can read SSE events and usage; the client gets identity.
	"Accept-Encoding",
}

// Header builds the headers of a request to the upstream from the
// client's: hop-by-hop headers and the proxy's own (own) removed,
// credentials replaced when the proxy holds upstream.api_key.
func (c *Client) Header(in http.Header, own ...string) http.Header {
	h := in.Clone()
	if conn := in.Get("Connection"); conn != "" {
		for _, f := range strings.Split(conn, ",") {
			h.Del(strings.TrimSpace(f))
		}
	}
	for _, k := range hopHeaders {
		h.Del(k)
	}
	for _, k := range own {
		h.Del(k)
	}
	SetKey(h, c.cfg.APIKey.Reveal(), c.cfg.Dialect)
	return h
}

// CopyResponseHeader copies the upstream's response headers to the
// client's, without hop-by-hop headers and Content-Length (the body may
// change).
func CopyResponseHeader(dst, src http.Header) {
	for k, vv := range src {
		switch http.CanonicalHeaderKey(k) {
		case "Connection", "Keep-Alive", "Transfer-Encoding", "Trailer", "Content-Length", "Upgrade", "Proxy-Connection":
			continue
		}
		dst[k] = append([]string(nil), vv...)
	}
}
