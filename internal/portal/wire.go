package portal

import (
	"fmt"
	"time"
)

// The delegation socket's protocol (stable; docs/portals.md): one JSON
// request line per connection, one JSON response line back. A "connect"
// answer that succeeds carries the connected socket as SCM_RIGHTS on the
// response's first byte. A held session ("hold": true) keeps its connection
// open: the session ends when it closes.

// Operations.
const (
	OpSession  = "session"  // a user: "my proxy may act for me"
	OpEnd      = "end"      // a user: end my sessions (with one proxy, or all)
	OpSessions = "sessions" // list: root all, a proxy those naming it, a user hers
	OpConnect  = "connect"  // a proxy: a connection to Address as User
)

// Request is one request.
type Request struct {
	Op string `json:"op"`
	// Proxy is the proxy account a session is for (name or uid).
	Proxy string `json:"proxy,omitempty"`
	// Group is the group a session's connections carry (name or gid;
	// the user must be a member); empty: the user's primary group.
	Group string `json:"group,omitempty"`
	// TTL is how long a session lasts (a Go duration, at most [portal]
	// max_session; empty: max_session).
	TTL string `json:"ttl,omitempty"`
	// Hold: the session also ends when this connection closes.
	Hold bool `json:"hold,omitempty"`
	// User is whom a connection is for (name or uid).
	User string `json:"user,omitempty"`
	// Address is where to connect: host:port (an address or a name the
	// agent's node resolves); TCP only.
	Address string `json:"address,omitempty"`
}

// Error codes.
const (
	CodeBadRequest  = "bad-request" // malformed, unknown op, bad address
	CodeForbidden   = "forbidden"   // not a proxy, no session, root, exempt, ...
	CodeUnreachable = "unreachable" // the connection failed (refused, timeout)
	CodeInternal    = "internal"
)

// Response answers a Request.
type Response struct {
	OK    bool   `json:"ok"`
	Code  string `json:"code,omitempty"`
	Error string `json:"error,omitempty"`
	// A connection's owner as the kernel recorded it (connect), or a
	// session's (session).
	UID uint32 `json:"uid,omitempty"`
	GID uint32 `json:"gid,omitempty"`
	// Address is the peer a connection was made to.
	Address string `json:"address,omitempty"`
	// Expires is when a registered session ends.
	Expires  time.Time `json:"expires,omitzero"`
	Sessions []Session `json:"sessions,omitempty"`
	// Ended counts the sessions an "end" removed.
	Ended int `json:"ended,omitempty"`
}

// Session is one user's permission for one proxy.
type Session struct {
	User     string    `json:"user"`
	UID      uint32    `json:"uid"`
	Proxy    string    `json:"proxy"`
	ProxyUID uint32    `json:"proxy_uid"`
	Group    string    `json:"group,omitempty"`
	GID      uint32    `json:"gid"`
	Started  time.Time `json:"started"`
	Expires  time.Time `json:"expires"`
	Held     bool      `json:"held,omitempty"`
}

// Error is a refusal or failure the agent reported.
type Error struct {
	Code string
	Msg  string
}

func (e *Error) Error() string { return fmt.Sprintf("portal: %s", e.Msg) }

func (r *Response) err() error {
	if r.OK {
		return nil
	}
	code := r.Code
	if code == "" {
		code = CodeInternal
	}
	return &Error{Code: code, Msg: r.Error}
}
