package identity

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// User is one passwd entry.
type User struct {
	Name string
	UID  uint32
	GID  uint32 // primary group
}

// Group is one group entry; Members are user names (supplementary members).
type Group struct {
	Name    string
	GID     uint32
	Members []string
}

// Table is an in-memory user and group database: the parsed /etc files, an
// enumerated NSS snapshot, or a fixture in tests. The first entry wins when a
// name or id repeats, as in NSS "files".
type Table struct {
	Users  []User
	Groups []Group
}

var _ Resolver = (*Table)(nil)

// LookupUser implements Resolver.
func (t *Table) LookupUser(name string) (uint32, uint32, error) {
	for _, u := range t.Users {
		if u.Name == name {
			return u.UID, u.GID, nil
		}
	}
	return 0, 0, &UnknownUserError{name}
}

// LookupUID implements Resolver.
func (t *Table) LookupUID(uid uint32) (string, error) {
	for _, u := range t.Users {
		if u.UID == uid {
			return u.Name, nil
		}
	}
	return "", &UnknownIDError{"uid", uid}
}

// LookupGroup implements Resolver.
func (t *Table) LookupGroup(name string) (uint32, error) {
	for _, g := range t.Groups {
		if g.Name == name {
			return g.GID, nil
		}
	}
	return 0, &UnknownGroupError{name}
}

// LookupGID implements Resolver.
func (t *Table) LookupGID(gid uint32) (string, error) {
	for _, g := range t.Groups {
		if g.GID == gid {
			return g.Name, nil
		}
	}
	return "", &UnknownIDError{"gid", gid}
}

// GroupsOf implements Resolver: the primary gid, then every group listing
// the user as a member, in file order.
func (t *Table) GroupsOf(user string) ([]uint32, error) {
	_, gid, err := t.LookupUser(user)
	if err != nil {
		return nil, err
	}
	return t.groupsOf(user, gid), nil
}

func (t *Table) groupsOf(user string, primary uint32) []uint32 {
	gids := []uint32{primary}
	for _, g := range t.Groups {
		for _, m := range g.Members {
			if m == user {
				gids = append(gids, g.GID)
				break
			}
		}
	}
	return dedupe(gids)
}

// Members implements Resolver. A uid or a name listed twice keeps its first
// entry: a shadowed name can never log in, so its uid gets no groups.
func (t *Table) Members() (Membership, error) {
	// One pass over the groups: a site database has thousands of users and
	// groups, and the agent refreshes this every minute.
	supp := map[string][]uint32{}
	for _, g := range t.Groups {
		for _, m := range g.Members {
			supp[m] = append(supp[m], g.GID)
		}
	}
	m := make(Membership, len(t.Users))
	names := make(map[string]bool, len(t.Users))
	for _, u := range t.Users {
		if _, seen := m[u.UID]; !seen && !names[u.Name] {
			m[u.UID] = dedupe(append([]uint32{u.GID}, supp[u.Name]...))
		}
		names[u.Name] = true
	}
	return m, nil
}

// ReadFiles parses a passwd and a group file (the /etc formats).
func ReadFiles(passwdPath, groupPath string) (*Table, error) {
	pw, err := os.ReadFile(passwdPath)
	if err != nil {
		return nil, err
	}
	gr, err := os.ReadFile(groupPath)
	if err != nil {
		return nil, err
	}
	return ParseTables(pw, gr)
}

// ParseTables parses passwd and group data. Blank lines, comments and NIS
// compat lines ("+", "-") are skipped; a malformed line is an error naming it.
func ParseTables(passwd, group []byte) (*Table, error) {
	t := &Table{}
	err := eachEntry(passwd, 7, func(f []string) error {
		uid, err := atoid(f[2])
		if err != nil {
			return fmt.Errorf("uid: %w", err)
		}
		gid, err := atoid(f[3])
		if err != nil {
			return fmt.Errorf("gid: %w", err)
		}
		t.Users = append(t.Users, User{Name: f[0], UID: uid, GID: gid})
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("passwd %w", err)
	}
	err = eachEntry(group, 4, func(f []string) error {
		gid, err := atoid(f[2])
		if err != nil {
			return fmt.Errorf("gid: %w", err)
		}
		g := Group{Name: f[0], GID: gid}
		for _, m := range strings.Split(f[3], ",") {
			if m = strings.TrimSpace(m); m != "" {
				g.Members = append(g.Members, m)
			}
		}
		t.Groups = append(t.Groups, g)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("group %w", err)
	}
	return t, nil
}

func eachEntry(data []byte, nfields int, fn func([]string) error) error {
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(nil, 1<<20) // large groups have long member lists
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || line[0] == '+' || line[0] == '-' {
			continue
		}
		f := strings.Split(line, ":")
		if len(f) != nfields || f[0] == "" {
			return fmt.Errorf("line %d: want %d colon-separated fields, got %d", n, nfields, len(f))
		}
		if err := fn(f); err != nil {
			return fmt.Errorf("line %d: %w", n, err)
		}
	}
	return sc.Err()
}

func atoid(s string) (uint32, error) {
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil || n > maxID {
		return 0, fmt.Errorf("bad id %q", s)
	}
	return uint32(n), nil
}
