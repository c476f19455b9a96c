package proxy

import (
	"encoding/json"
	"net/http"
)

// apiError is OpenAI's error envelope body.
type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

// writeError answers status with OpenAI's JSON error envelope. param and code
// may be "" (encoded as null, as OpenAI does).
func writeError(w http.ResponseWriter, status int, typ, code, param, msg string) {
	e := apiError{Message: msg, Type: typ}
	if param != "" {
		e.Param = &param
	}
	if code != "" {
		e.Code = &code
	}
	body, _ := json.Marshal(struct {
		Error apiError `json:"error"`
	}{e})
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Del("Content-Length")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

func writeInvalid(w http.ResponseWriter, param, msg string) {
	writeError(w, http.StatusBadRequest, "invalid_request_error", "", param, msg)
}
