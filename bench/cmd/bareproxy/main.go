// Command bareproxy is the load harness's floor: a plain
// httputil.ReverseProxy in its own process, in front of the mock upstream.
// Whatever it adds over calling the mock directly is the cost of the extra
// hop alone (a second connection, a second HTTP parse and write, the copy);
// compactproxy's targets are stated as ratios to it.
//
// It is tuned the way any production Go proxy is: Rewrite (not the
// deprecated Director), FlushInterval -1 so SSE events are not held back, and
// an idle pool large enough for the harness's 32 concurrent clients (the
// default of 2 idle connections per host would make the floor artificially
// slow by re-dialing at c=32).
package main

import (
	"flag"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to bind")
	addrFile := flag.String("addr-file", "", "write the bound address to this file")
	upstream := flag.String("upstream", "", "upstream root URL, e.g. http://127.0.0.1:9000")
	flag.Parse()

	target, err := url.Parse(*upstream)
	if err != nil || target.Scheme == "" || target.Host == "" {
		log.Fatalf("bareproxy: -upstream %q: want an absolute URL", *upstream)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns = 256
	tr.MaxIdleConnsPerHost = 256
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.SetXForwarded()
		},
		FlushInterval: -1,
		Transport:     tr,
	}

	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatalf("bareproxy: listen: %v", err)
	}
	if *addrFile != "" {
		if err := os.WriteFile(*addrFile, []byte(ln.Addr().String()), 0o644); err != nil {
			log.Fatalf("bareproxy: %v", err)
		}
	}
	log.Fatal((&http.Server{Handler: rp}).Serve(ln))
}
