package portal

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"regexp"
	"strconv"
	"strings"
)

// Forwarder is the HTTP reverse proxy a web server puts in front of the
// delegation, since Apache and nginx cannot receive a descriptor: it runs
// as the proxy account, takes the authenticated user from a header the web
// server sets (UserHeader) or from the path the portal's router wrote
// (UserHeader ""), the target from OnDemand's routes, and carries each
// request over a connection the agent made as that user.
//
//	/rnode/<host>/<port>/<rest>  →  http://<host>:<port>/<rest>          (prefix stripped)
//	/node/<host>/<port>/<rest>   →  http://<host>:<port>/node/<host>/<port>/<rest>  (kept)
//	with UserHeader "": /as/<user>/ before either.
//
// Connections are never reused between requests (no keep-alive pool): a
// pooled connection made as alice must never carry bob's request.
type Forwarder struct {
	// Agent is the delegation socket.
	Agent string
	// UserHeader names the header holding the authenticated user; the web
	// server must set it on every request (replacing what a client sent).
	// Empty: the user is the path's /as/<user>/ segment.
	UserHeader string
	// HostRE, if set, is what a host must match in full (OnDemand's
	// host_regex).
	HostRE *regexp.Regexp
	Log    *slog.Logger

	proxy *httputil.ReverseProxy
	// dial is Dial (tests replace it).
	dial func(ctx context.Context, socketPath, user, address string) (net.Conn, error)
}

type ctxKey struct{}

type route struct {
	user, host, port, path string
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9._@-]*$`)

// parse finds the user and target of a request.
func (f *Forwarder) parse(r *http.Request) (route, error) {
	var rt route
	p := r.URL.Path
	if f.UserHeader == "" {
		rest, ok := strings.CutPrefix(p, "/as/")
		if !ok {
			return rt, errors.New("want /as/<user>/(r)node/<host>/<port>/")
		}
		rt.user, p, _ = strings.Cut(rest, "/")
		p = "/" + p
	} else {
		vs := r.Header.Values(f.UserHeader)
		if len(vs) != 1 {
			return rt, fmt.Errorf("want exactly one %s header (set by the web server after authentication)", f.UserHeader)
		}
		rt.user = vs[0]
	}
	if !nameRE.MatchString(rt.user) {
		return rt, fmt.Errorf("bad user %q", rt.user)
	}
	var kind, rest string
	var ok bool
	if rest, ok = strings.CutPrefix(p, "/rnode/"); ok {
		kind = "rnode"
	} else if rest, ok = strings.CutPrefix(p, "/node/"); ok {
		kind = "node"
	} else {
		return rt, errors.New("want /rnode/<host>/<port>/ or /node/<host>/<port>/")
	}
	parts := strings.SplitN(rest, "/", 3)
	if len(parts) < 2 {
		return rt, errors.New("want <host>/<port>/")
	}
	rt.host, rt.port = parts[0], parts[1]
	if n, err := strconv.ParseUint(rt.port, 10, 16); err != nil || n == 0 {
		return rt, fmt.Errorf("bad port %q", rt.port)
	}
	if !nameRE.MatchString(rt.host) && net.ParseIP(rt.host) == nil {
		return rt, fmt.Errorf("bad host %q", rt.host)
	}
	if f.HostRE != nil && !f.HostRE.MatchString(rt.host) {
		return rt, fmt.Errorf("host %q is not one the portal proxies to", rt.host)
	}
	tail := ""
	if len(parts) == 3 {
		tail = parts[2]
	}
	if kind == "rnode" {
		rt.path = "/" + tail
	} else {
		rt.path = "/node/" + rt.host + "/" + rt.port + "/" + tail
	}
	return rt, nil
}

func (f *Forwarder) init() {
	if f.proxy != nil {
		return
	}
	if f.dial == nil {
		f.dial = Dial
	}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			rt, _ := ctx.Value(ctxKey{}).(route)
			if rt.user == "" {
				return nil, errors.New("no user for this connection")
			}
			return f.dial(ctx, f.Agent, rt.user, net.JoinHostPort(rt.host, rt.port))
		},
		DisableKeepAlives: true,
		Proxy:             nil,
	}
	f.proxy = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			rt, _ := pr.In.Context().Value(ctxKey{}).(route)
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = net.JoinHostPort(rt.host, rt.port)
			pr.Out.URL.Path, pr.Out.URL.RawPath = rt.path, ""
			pr.Out.Host = pr.In.Host
			if f.UserHeader != "" {
				pr.Out.Header.Del(f.UserHeader)
			}
		},
		Transport: tr,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			rt, _ := r.Context().Value(ctxKey{}).(route)
			code := http.StatusBadGateway
			var pe *Error
			if errors.As(err, &pe) && (pe.Code == CodeForbidden) {
				code = http.StatusForbidden
			}
			if f.Log != nil {
				f.Log.Warn("portal forward failed", "user", rt.user, "host", rt.host, "port", rt.port, "status", code, "err", err)
			}
			http.Error(w, err.Error(), code)
		},
	}
}

// ServeHTTP forwards one request.
func (f *Forwarder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.init()
	rt, err := f.parse(r)
	if err != nil {
		http.Error(w, "portal: "+err.Error(), http.StatusBadRequest)
		return
	}
	f.proxy.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), ctxKey{}, rt)))
}
