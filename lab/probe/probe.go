// Package probe is the real traffic behind `palisade-lab check` and the
// benchmarks: a cheap listener that serves TCP and UDP on IPv4 and IPv6 on
// many ports and answers every request with the request's nonce and its own
// identity, and a connector that probes a plan of targets concurrently and
// reports, per case, whether data went both ways (and who answered) or how
// the attempt was refused.
//
// The wire format is deliberately tiny and line based so that one request and
// one reply fit in a single UDP datagram:
//
//	connector → listener:  PALPROBE1 <nonce> <case-id>\n
//	listener  → connector: {"nonce":"…","uid":2001,"gid":2100,"host":"node2","port":29101,"proto":"tcp"}\n
//
// A case counts as allowed only if the reply carries the nonce the connector
// sent, so a stale or foreign answer is never mistaken for a connection.
package probe

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
)

// magic opens every request; the version lets the format evolve.
const magic = "PALPROBE1"

// maxMsg bounds requests and replies (both fit in one datagram).
const maxMsg = 512

// Identity is who a probe process runs as: what the policy core calls the
// owner of a socket (uid, effective gid) plus the node it runs on.
type Identity struct {
	UID  uint32 `json:"uid"`
	GID  uint32 `json:"gid"`
	Host string `json:"host"`
}

func (id Identity) String() string {
	return fmt.Sprintf("uid=%d gid=%d host=%s", id.UID, id.GID, id.Host)
}

// Self returns the identity of the calling process: real uid, effective gid
// (what sg/newgrp changes) and hostname (the UTS namespace's name).
func Self() Identity {
	h, _ := os.Hostname()
	return Identity{UID: uint32(os.Getuid()), GID: uint32(os.Getegid()), Host: h}
}

// Reply is what a listener answers.
type Reply struct {
	Nonce string `json:"nonce"`
	Identity
	Port  uint16 `json:"port"`
	Proto string `json:"proto"`
}

func formatRequest(nonce, id string) []byte {
	// Case ids are ours, but keep the line well formed whatever they hold.
	id = strings.Map(func(r rune) rune {
		if r <= ' ' || r > '~' {
			return '_'
		}
		return r
	}, id)
	return []byte(magic + " " + nonce + " " + id + "\n")
}

// parseRequest returns the nonce of a well-formed request.
func parseRequest(b []byte) (string, error) {
	f := strings.Fields(string(b))
	if len(f) < 2 || f[0] != magic || len(f[1]) == 0 || len(f[1]) > 64 {
		return "", errors.New("not a probe request")
	}
	return f[1], nil
}

func formatReply(r Reply) []byte {
	b, _ := json.Marshal(r)
	return append(b, '\n')
}

func parseReply(b []byte) (Reply, error) {
	var r Reply
	if err := json.Unmarshal(b, &r); err != nil {
		return r, fmt.Errorf("bad reply: %w", err)
	}
	return r, nil
}

// readLine reads one line of at most maxMsg bytes.
func readLine(r io.Reader) ([]byte, error) {
	br := bufio.NewReaderSize(io.LimitReader(r, maxMsg), maxMsg)
	line, err := br.ReadSlice('\n')
	if err != nil {
		if errors.Is(err, io.EOF) && len(line) == 0 {
			return nil, io.EOF
		}
		if !errors.Is(err, io.EOF) {
			return nil, err
		}
		return nil, io.ErrUnexpectedEOF
	}
	return line, nil
}
