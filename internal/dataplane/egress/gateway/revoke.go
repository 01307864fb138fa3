package gateway

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/palisade-hpc/palisade/internal/dataplane/egress/ipam"
)

// Revocations lists what may no longer join; a running gateway re-reads the
// file within a second and drops the matching peers at once.
type Revocations struct {
	Users []string `json:"users,omitempty"` // every job of the user
	Jobs  []string `json:"jobs,omitempty"`  // "user/job"
	Keys  []string `json:"keys,omitempty"`  // client public keys
}

func revocationPath(dir string) string { return filepath.Join(dir, "revoked.json") }

// LoadRevocations reads the revocation list (none if the file is missing).
func LoadRevocations(dir string) (Revocations, error) {
	var r Revocations
	b, err := os.ReadFile(revocationPath(dir))
	if errors.Is(err, os.ErrNotExist) {
		return r, nil
	}
	if err != nil {
		return r, err
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return r, fmt.Errorf("%s: %v", revocationPath(dir), err)
	}
	return r, nil
}

// Match reports whether a lease (or join attempt) is revoked.
func (r Revocations) Match(l ipam.Lease) bool {
	return slices.Contains(r.Users, l.User) || slices.Contains(r.Jobs, l.User+"/"+l.Job) ||
		(l.Key != "" && slices.Contains(r.Keys, l.Key))
}

// Revoke adds entries ("user", "user/job" or "key:<base64>") to the list.
func Revoke(dir string, what ...string) error {
	r, err := LoadRevocations(dir)
	if err != nil {
		return err
	}
	for _, w := range what {
		switch {
		case strings.HasPrefix(w, "key:"):
			r.Keys = append(r.Keys, strings.TrimPrefix(w, "key:"))
		case strings.Contains(w, "/"):
			r.Jobs = append(r.Jobs, w)
		case w != "":
			r.Users = append(r.Users, w)
		default:
			return errors.New("revoke: empty entry")
		}
	}
	b, _ := json.MarshalIndent(r, "", " ")
	tmp := revocationPath(dir) + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, revocationPath(dir))
}
