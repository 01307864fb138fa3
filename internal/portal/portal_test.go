package portal

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/identity"
)

func TestForwarderRoutes(t *testing.T) {
	f := &Forwarder{UserHeader: "X-Palisade-User", HostRE: regexp.MustCompile(`^node[0-9]+$`)}
	for _, c := range []struct {
		path, user, want, err string
		users                 []string
	}{
		{path: "/rnode/node2/8888/api/contents", users: []string{"alice"}, want: "alice node2 8888 /api/contents"},
		{path: "/rnode/node2/8888/", users: []string{"alice"}, want: "alice node2 8888 /"},
		{path: "/rnode/node2/8888", users: []string{"alice"}, want: "alice node2 8888 /"},
		{path: "/node/node2/8888/lab", users: []string{"alice"}, want: "alice node2 8888 /node/node2/8888/lab"},
		{path: "/rnode/node2/8888/", err: "exactly one"},
		{path: "/rnode/node2/8888/", users: []string{"alice", "bob"}, err: "exactly one"},
		{path: "/rnode/node2/0/", users: []string{"alice"}, err: "bad port"},
		{path: "/rnode/node2/99999/", users: []string{"alice"}, err: "bad port"},
		{path: "/rnode/outside/80/", users: []string{"alice"}, err: "not one the portal"},
		{path: "/rnode/node2/80/", users: []string{"../root"}, err: "bad user"},
		{path: "/other/node2/80/", users: []string{"alice"}, err: "want /rnode"},
	} {
		r := httptest.NewRequest("GET", c.path, nil)
		for _, u := range c.users {
			r.Header.Add("X-Palisade-User", u)
		}
		rt, err := f.parse(r)
		got := ""
		if err == nil {
			got = rt.user + " " + rt.host + " " + rt.port + " " + rt.path
		}
		if c.err != "" {
			if err == nil || !regexp.MustCompile(regexp.QuoteMeta(c.err)).MatchString(err.Error()) {
				t.Errorf("%s %v: got %q, %v; want error %q", c.path, c.users, got, err, c.err)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("%s %v: got %q, %v; want %q", c.path, c.users, got, err, c.want)
		}
	}
	p := &Forwarder{}
	rt, err := p.parse(httptest.NewRequest("GET", "/as/bob/rnode/node1/9000/x", nil))
	if err != nil || rt.user != "bob" || rt.host != "node1" || rt.path != "/x" {
		t.Errorf("path user: %+v %v", rt, err)
	}
}

type noKernel struct{ exempt map[uint32]bool }

func (k noKernel) ExemptConnector(uid uint32) (bool, error) { return k.exempt[uid], nil }
func (noKernel) SocketOwner(int) (uint32, uint32, error)    { return 0, 0, io.EOF }

// The refusals, decided before any socket exists.
func TestDelegationRefusals(t *testing.T) {
	res, err := identity.ParseTables([]byte(`root:x:0:0::/:/bin/sh
www-data:x:33:33::/:/bin/sh
alice:x:2001:2001::/:/bin/sh
bob:x:2002:2002::/:/bin/sh
svc:x:2004:2004::/:/bin/sh
ghost:x:2005:2005::/:/bin/sh
`), []byte(`root:x:0:
www-data:x:33:
alice:x:2001:
bob:x:2002:
svc:x:2004:
proj1:x:2100:alice,bob
other:x:2200:bob
`))
	if err != nil {
		t.Fatal(err)
	}
	var cfg Config
	cfg.SetDefaults()
	cfg.Proxies = []string{"www-data"}
	s := NewServer(noKernel{map[uint32]bool{2005: true}}, res, Settings{Config: cfg, Exempt: []uint32{0, 2004}}, slog.New(slog.DiscardHandler))
	now := time.Unix(1000000, 0)
	s.now = func() time.Time { return now }
	ctx := context.Background()
	code := func(r Response, _ int) string { return r.Code + ": " + r.Error }
	for _, c := range []struct {
		name string
		peer uint32
		req  Request
		want string
	}{
		{"not a proxy", 2002, Request{Op: OpConnect, User: "alice", Address: "198.18.0.2:80"}, "not a [portal] proxy"},
		{"root", 33, Request{Op: OpConnect, User: "root", Address: "198.18.0.2:80"}, "root is never"},
		{"system account", 33, Request{Op: OpConnect, User: "www-data", Address: "198.18.0.2:80"}, "below [portal] min_uid"},
		{"exempt (configuration)", 33, Request{Op: OpConnect, User: "svc", Address: "198.18.0.2:80"}, "exempt connector"},
		{"exempt (kernel map)", 33, Request{Op: OpConnect, User: "ghost", Address: "198.18.0.2:80"}, "exempt connector"},
		{"unknown user", 33, Request{Op: OpConnect, User: "nobody2", Address: "198.18.0.2:80"}, "unknown user"},
		{"no session", 33, Request{Op: OpConnect, User: "alice", Address: "198.18.0.2:80"}, "no session"},
	} {
		if got := code(s.connect(ctx, c.peer, c.req)); !regexp.MustCompile(regexp.QuoteMeta(c.want)).MatchString(got) {
			t.Errorf("%s: got %q, want %q", c.name, got, c.want)
		}
	}
	// Sessions: only for a proxy, only in one's groups, never for root.
	if r, _ := s.register(2001, Request{Op: OpSession, Proxy: "bob"}); r.OK {
		t.Error("a session for a non-proxy was registered")
	}
	if r, _ := s.register(2001, Request{Op: OpSession, Proxy: "www-data", Group: "other"}); r.OK {
		t.Error("a session with a group alice is not in was registered")
	}
	if r, _ := s.register(0, Request{Op: OpSession, Proxy: "www-data"}); r.OK {
		t.Error("root registered a session")
	}
	r, _ := s.register(2001, Request{Op: OpSession, Proxy: "www-data", Group: "proj1", TTL: "1m"})
	if !r.OK || r.GID != 2100 || !r.Expires.Equal(now.Add(time.Minute)) {
		t.Fatalf("alice's session: %+v", r)
	}
	if ss := s.sessionFor(2001, 33); ss == nil || ss.GID != 2100 {
		t.Fatalf("alice's session not found: %+v", ss)
	}
	// alice's session is not bob's, nor another proxy's.
	if s.sessionFor(2002, 33) != nil || s.sessionFor(2001, 2002) != nil {
		t.Error("a session was found for someone else")
	}
	now = now.Add(time.Minute)
	if s.sessionFor(2001, 33) != nil {
		t.Error("an expired session is still in force")
	}
	s.register(2001, Request{Op: OpSession, Proxy: "www-data"})
	if r := s.end(2001, Request{Op: OpEnd}); r.Ended != 1 || s.sessionFor(2001, 33) != nil {
		t.Errorf("end: %+v", r)
	}
	// A proxy that is taken off the list cannot use its sessions.
	s.register(2001, Request{Op: OpSession, Proxy: "www-data"})
	cfg.Proxies = nil
	s.SetSettings(Settings{Config: cfg})
	if got := code(s.connect(ctx, 33, Request{Op: OpConnect, User: "alice", Address: "198.18.0.2:80"})); !regexp.MustCompile("not a .portal. proxy").MatchString(got) {
		t.Errorf("delisted proxy: %q", got)
	}
	// … nor get them back when it is listed again (redteam, session 7).
	cfg.Proxies = []string{"www-data"}
	s.SetSettings(Settings{Config: cfg, Exempt: []uint32{0, 2004}})
	if s.sessionFor(2001, 33) != nil {
		t.Error("a session of a delisted proxy came back when it was listed again")
	}
	// A user is a name: a login made of digits is not read as a uid
	// (alice is 2001; "2001" is nobody's name here).
	s.register(2001, Request{Op: OpSession, Proxy: "www-data"})
	if got := code(s.connect(ctx, 33, Request{Op: OpConnect, User: "2001", Address: "198.18.0.2:80"})); !regexp.MustCompile(`user "2001"`).MatchString(got) {
		t.Errorf("numeric user: %q", got)
	}
}

// Every request gets a connection of its own, made for its own user: a
// connection made as alice never carries bob's request (no keep-alive
// pool), and the user header does not reach the app.
func TestForwarderNeverReuses(t *testing.T) {
	var mu sync.Mutex
	var dials []string
	app := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, r.URL.Path+" "+r.Header.Get("X-Palisade-User"))
	}))
	defer app.Close()
	_, port, _ := net.SplitHostPort(app.Listener.Addr().String())
	f := &Forwarder{UserHeader: "X-Palisade-User", dial: func(ctx context.Context, _, user, address string) (net.Conn, error) {
		mu.Lock()
		dials = append(dials, user+"@"+address)
		mu.Unlock()
		var d net.Dialer
		return d.DialContext(ctx, "tcp", app.Listener.Addr().String())
	}}
	srv := httptest.NewServer(f)
	defer srv.Close()
	for _, u := range []string{"alice", "bob", "alice"} {
		req, _ := http.NewRequest("GET", srv.URL+"/rnode/127.0.0.1/"+port+"/x", nil)
		req.Header.Set("X-Palisade-User", u)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(b) != "/x " {
			t.Errorf("%s: the app saw %q, want the path /x and no user header", u, b)
		}
	}
	want := []string{"alice@127.0.0.1:" + port, "bob@127.0.0.1:" + port, "alice@127.0.0.1:" + port}
	if !slices.Equal(dials, want) {
		t.Errorf("dials %v, want one per request %v", dials, want)
	}
}

// TestSlowClientsPerUID: the socket is open to every user, and a client that
// sends nothing holds its slot for requestTimeout. One uid gets maxPerUID
// slots at once (the next connection is closed unanswered), and a slot is
// free again once its client goes.
func TestSlowClientsPerUID(t *testing.T) {
	res, err := identity.ParseTables([]byte("root:x:0:0::/:/bin/sh\n"), []byte("root:x:0:\n"))
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(noKernel{}, res, Settings{}, slog.New(slog.DiscardHandler))
	path := t.TempDir() + "/portal.sock"
	if err := srv.Listen(path); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { srv.Serve(ctx); close(done) }()
	defer func() { srv.Close(); cancel(); <-done }()

	// The server counts a connection when it accepts it: wait for each
	// of the slow ones to be counted before the next.
	var slow []net.Conn
	for i := 0; i < maxPerUID; i++ {
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		slow = append(slow, c)
		for deadline := time.Now().Add(5 * time.Second); ; {
			srv.mu.Lock()
			n := srv.inflight[0]
			srv.mu.Unlock()
			if n == i+1 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("connection %d not counted (in flight %d)", i+1, n)
			}
			time.Sleep(time.Millisecond)
		}
	}
	ask := func() (string, error) {
		c, err := net.Dial("unix", path)
		if err != nil {
			return "", err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.WriteString(c, `{"op":"sessions"}`+"\n"); err != nil {
			return "", err
		}
		b, err := io.ReadAll(c)
		return string(b), err
	}
	// Closed unanswered: EOF, or a reset when the request was unread.
	if got, _ := ask(); got != "" {
		t.Fatalf("a request over the per-uid bound was answered: %q", got)
	}
	for _, c := range slow {
		c.Close()
	}
	for deadline := time.Now().Add(5 * time.Second); ; {
		got, err := ask()
		if err == nil && strings.Contains(got, `"ok":true`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("slots not freed after the slow clients went: %q, %v", got, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
