package identity

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"time"
)

// NSS resolves through getent(1), i.e. the node's full NSS configuration
// (files, LDAP, SSSD, ...). Without getent it reads the /etc files.
type NSS struct {
	// Getent is the getent binary; empty means use the files.
	Getent string
	// Passwd and Group are the files read when Getent is empty.
	Passwd, Group string
	// Timeout bounds one getent call (a hung LDAP server must not hang the
	// agent); zero means 10 s.
	Timeout time.Duration
}

var _ Resolver = (*NSS)(nil)

// System returns the resolver of this node: getent when it is installed, the
// /etc files otherwise.
func System() *NSS {
	n := &NSS{Passwd: "/etc/passwd", Group: "/etc/group"}
	if p, err := exec.LookPath("getent"); err == nil {
		n.Getent = p
	}
	return n
}

// errNotFound is getent's exit status 2: the key is not in the database.
var errNotFound = errors.New("not found")

// getent runs one query and returns its output lines.
func (n *NSS) getent(args ...string) ([]string, error) {
	to := n.Timeout
	if to == 0 {
		to = 10 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), to)
	defer cancel()
	var out, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, n.Getent, args...)
	cmd.Stdout, cmd.Stderr = &out, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() == 2 {
		return nil, errNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("getent %s: %v %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	var lines []string
	for _, l := range strings.Split(out.String(), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			lines = append(lines, l)
		}
	}
	return lines, nil
}

// table is the whole database: enumerated through getent or read from files.
func (n *NSS) table() (*Table, error) {
	if n.Getent == "" {
		return ReadFiles(n.Passwd, n.Group)
	}
	pw, err := n.getent("passwd")
	if err != nil {
		return nil, err
	}
	gr, err := n.getent("group")
	if err != nil {
		return nil, err
	}
	return ParseTables([]byte(strings.Join(pw, "\n")), []byte(strings.Join(gr, "\n")))
}

// one looks up a single key; getent asks NSS for exactly that key, which
// works even where enumeration is disabled.
func (n *NSS) one(db, key string) (*Table, error) {
	lines, err := n.getent(db, key)
	if errors.Is(err, errNotFound) {
		return &Table{}, nil
	}
	if err != nil {
		return nil, err
	}
	data := []byte(strings.Join(lines, "\n"))
	if db == "passwd" {
		return ParseTables(data, nil)
	}
	return ParseTables(nil, data)
}

// LookupUser implements Resolver.
func (n *NSS) LookupUser(name string) (uint32, uint32, error) {
	t, err := n.query("passwd", name)
	if err != nil {
		return 0, 0, err
	}
	return t.LookupUser(name)
}

// LookupUID implements Resolver.
func (n *NSS) LookupUID(uid uint32) (string, error) {
	t, err := n.query("passwd", fmt.Sprint(uid))
	if err != nil {
		return "", err
	}
	return t.LookupUID(uid)
}

// LookupGroup implements Resolver.
func (n *NSS) LookupGroup(name string) (uint32, error) {
	t, err := n.query("group", name)
	if err != nil {
		return 0, err
	}
	return t.LookupGroup(name)
}

// LookupGID implements Resolver.
func (n *NSS) LookupGID(gid uint32) (string, error) {
	t, err := n.query("group", fmt.Sprint(gid))
	if err != nil {
		return "", err
	}
	return t.LookupGID(gid)
}

func (n *NSS) query(db, key string) (*Table, error) {
	if n.Getent == "" {
		return ReadFiles(n.Passwd, n.Group)
	}
	return n.one(db, key)
}

// GroupsOf implements Resolver. With getent it asks "initgroups", the same
// call login uses, so it sees groups from every NSS source.
func (n *NSS) GroupsOf(user string) ([]uint32, error) {
	_, gid, err := n.LookupUser(user)
	if err != nil {
		return nil, err
	}
	if n.Getent == "" {
		t, err := ReadFiles(n.Passwd, n.Group)
		if err != nil {
			return nil, err
		}
		return t.groupsOf(user, gid), nil
	}
	lines, err := n.getent("initgroups", user)
	if err != nil && !errors.Is(err, errNotFound) {
		return nil, err
	}
	gids := []uint32{gid}
	for _, l := range lines {
		f := strings.Fields(l)
		if len(f) == 0 || f[0] != user {
			continue
		}
		for _, s := range f[1:] {
			g, err := atoid(s)
			if err != nil {
				return nil, fmt.Errorf("getent initgroups %s: %w", user, err)
			}
			gids = append(gids, g)
		}
	}
	return dedupe(gids), nil
}

// Members implements Resolver from an enumeration of passwd and group.
func (n *NSS) Members() (Membership, error) {
	t, err := n.table()
	if err != nil {
		return nil, err
	}
	return t.Members()
}
