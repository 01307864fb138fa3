package testbed

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// User is one of the testbed's accounts.
type User struct {
	Name string
	UID  uint32 // the private group has the same id
}

// Users are the testbed's accounts, shared by all instances.
var Users = []User{{"alice", 2001}, {"bob", 2002}, {"carol", 2003}, {"svc", 2004}}

// ProjectGroup is the project group alice and bob belong to.
const (
	ProjectGroup    = "proj1"
	ProjectGID      = 2100
	projectMembers  = "alice,bob"
	sharedStateFile = "shared.json"
	sharedLockFile  = ".lock"
)

// HomeDir is where the testbed's users live (shared by instances, like an
// NFS home, and usable on every node).
var HomeDir = filepath.Join(BaseDir, "home")

// shared is what the instances share: the users and a few host
// directories that must exist for the /etc/netns overlay and sshd.
// Whatever the testbed created is removed when the last instance goes down.
type shared struct {
	Instances []string `json:"instances"`
	Users     []string `json:"users_created,omitempty"`
	Groups    []string `json:"groups_created,omitempty"`
	Dirs      []string `json:"dirs_created,omitempty"`
}

// withShared runs f holding the lock on the shared state and saves it after.
func withShared(f func(s *shared) error) error {
	if err := os.MkdirAll(BaseDir, 0o755); err != nil {
		return err
	}
	lf, err := os.OpenFile(filepath.Join(BaseDir, sharedLockFile), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return err
	}
	defer lf.Close()
	if err := unix.Flock(int(lf.Fd()), unix.LOCK_EX); err != nil {
		return err
	}
	defer unix.Flock(int(lf.Fd()), unix.LOCK_UN)
	p := filepath.Join(BaseDir, sharedStateFile)
	var s shared
	if b, err := os.ReadFile(p); err == nil {
		if err := json.Unmarshal(b, &s); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	// Forget instances whose directory is gone (crashed and wiped).
	s.Instances = slices.DeleteFunc(s.Instances, func(n string) bool {
		_, err := os.Stat(InstanceDir(n))
		return err != nil
	})
	ferr := f(&s)
	b, _ := json.MarshalIndent(&s, "", "  ")
	if err := os.WriteFile(p+".tmp", append(b, '\n'), 0o644); err != nil {
		return err
	}
	if err := os.Rename(p+".tmp", p); err != nil {
		return err
	}
	return ferr
}

// hostDirs must exist on the host: /etc/netns for the overlays, /etc/palisade
// as the mount point of the node's palisade overlay, /run/sshd as sshd's
// compiled-in privilege separation directory.
var hostDirs = []string{"/etc/netns", "/etc/palisade", "/run/sshd"}

// checkUsers verifies that existing accounts do not conflict with ours
// (before anything is created).
func checkUsers() error {
	for _, u := range Users {
		if err := checkID(u.Name, u.UID); err != nil {
			return err
		}
	}
	if g, err := user.LookupGroup(ProjectGroup); err == nil && g.Gid != strconv.Itoa(ProjectGID) {
		return fmt.Errorf("group %s exists with gid %s, the testbed needs %d", ProjectGroup, g.Gid, ProjectGID)
	}
	if g, err := user.LookupGroupId(strconv.Itoa(ProjectGID)); err == nil && g.Name != ProjectGroup {
		return fmt.Errorf("gid %d belongs to group %s, the testbed needs it for %s", ProjectGID, g.Name, ProjectGroup)
	}
	for _, n := range []string{"slurm", "munge"} {
		if _, err := user.Lookup(n); err != nil {
			return fmt.Errorf("user %s missing: install the Slurm and munge packages (.ci/deps)", n)
		}
	}
	return nil
}

func checkID(name string, id uint32) error {
	if u, err := user.Lookup(name); err == nil && u.Uid != strconv.Itoa(int(id)) {
		return fmt.Errorf("user %s exists with uid %s, the testbed needs %d", name, u.Uid, id)
	}
	if u, err := user.LookupId(strconv.Itoa(int(id))); err == nil && u.Username != name {
		return fmt.Errorf("uid %d belongs to %s, the testbed needs it for %s", id, u.Username, name)
	}
	if g, err := user.LookupGroupId(strconv.Itoa(int(id))); err == nil && g.Name != name {
		return fmt.Errorf("gid %d belongs to group %s, the testbed needs it for %s", id, g.Name, name)
	}
	return nil
}

// acquireShared registers instance name and creates the users and host
// directories that are missing.
func acquireShared(ctx context.Context, name string) error {
	return withShared(func(s *shared) error {
		if !slices.Contains(s.Instances, name) {
			s.Instances = append(s.Instances, name)
		}
		for _, d := range hostDirs {
			if _, err := os.Stat(d); errors.Is(err, os.ErrNotExist) {
				if err := os.Mkdir(d, 0o755); err != nil {
					return err
				}
				s.Dirs = append(s.Dirs, d)
			}
		}
		if err := os.MkdirAll(HomeDir, 0o755); err != nil {
			return err
		}
		for _, u := range Users {
			if _, err := user.Lookup(u.Name); err == nil {
				continue
			}
			id := strconv.Itoa(int(u.UID))
			if _, err := user.LookupGroup(u.Name); err != nil {
				if _, err := run(ctx, "", "groupadd", "-g", id, u.Name); err != nil {
					return err
				}
				s.Groups = append(s.Groups, u.Name)
			}
			// -p '*': with UsePAM no, sshd refuses accounts useradd
			// leaves locked ('!'); '*' has no password but is not locked.
			// No subordinate ids: nothing here uses user namespaces.
			if _, err := run(ctx, "", "useradd", "-u", id, "-g", id, "-M", "-d", filepath.Join(HomeDir, u.Name),
				"-s", "/bin/bash", "-p", "*", "-K", "SUB_UID_COUNT=0", "-K", "SUB_GID_COUNT=0", u.Name); err != nil {
				return err
			}
			s.Users = append(s.Users, u.Name)
		}
		if _, err := user.LookupGroup(ProjectGroup); err != nil {
			if _, err := run(ctx, "", "groupadd", "-g", strconv.Itoa(ProjectGID), ProjectGroup); err != nil {
				return err
			}
			s.Groups = append(s.Groups, ProjectGroup)
		}
		if slices.Contains(s.Groups, ProjectGroup) {
			// gpasswd -M writes the members to /etc/group and /etc/gshadow,
			// so `sg proj1` works for them without a password. Redone each
			// time: users re-created after a crash lose their membership.
			if _, err := run(ctx, "", "gpasswd", "-M", projectMembers, ProjectGroup); err != nil {
				return err
			}
		}
		for _, u := range Users {
			if err := ensureHome(ctx, u); err != nil {
				return err
			}
		}
		return nil
	})
}

// ensureHome creates the home directory and a passphrase-less ssh key whose
// public half is the only authorized key.
func ensureHome(ctx context.Context, u User) error {
	pw, err := user.Lookup(u.Name)
	if err != nil {
		return err
	}
	home := pw.HomeDir
	if !strings.HasPrefix(home, HomeDir+"/") {
		return nil // not ours: leave it alone (ssh as this user may need keys set up by hand)
	}
	uid, gid := int(u.UID), int(u.UID)
	sshDir := filepath.Join(home, ".ssh")
	key := filepath.Join(sshDir, "id_ed25519")
	if _, err := os.Stat(key); err == nil {
		return nil
	}
	if err := os.MkdirAll(sshDir, 0o700); err != nil {
		return err
	}
	if err := os.Chmod(home, 0o755); err != nil {
		return err
	}
	os.Remove(key)
	os.Remove(key + ".pub")
	if _, err := run(ctx, "", "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", u.Name+"@palisade-testbed", "-f", key); err != nil {
		return err
	}
	pub, err := os.ReadFile(key + ".pub")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(sshDir, "authorized_keys"), pub, 0o600); err != nil {
		return err
	}
	for _, p := range []string{home, sshDir, key, key + ".pub", filepath.Join(sshDir, "authorized_keys")} {
		if err := os.Lchown(p, uid, gid); err != nil {
			return err
		}
	}
	return nil
}

// releaseShared unregisters instance name; the last instance removes the
// users, groups and host directories the testbed created.
func releaseShared(ctx context.Context, name string) error {
	return withShared(func(s *shared) error {
		s.Instances = slices.DeleteFunc(s.Instances, func(n string) bool { return n == name })
		if len(s.Instances) > 0 {
			return nil
		}
		var errs []error
		// -f: other tests on this machine run processes under these uids
		// without an account (raw setuid); userdel would refuse then.
		var keepUsers, keepGroups []string
		for _, u := range s.Users {
			if _, err := user.Lookup(u); err == nil {
				if _, err := run(ctx, "", "userdel", "-f", u); err != nil {
					errs = append(errs, err)
					keepUsers = append(keepUsers, u)
				}
			}
		}
		s.Users = keepUsers
		for _, g := range s.Groups {
			if _, err := user.LookupGroup(g); err == nil {
				if _, err := run(ctx, "", "groupdel", g); err != nil {
					errs = append(errs, err)
					keepGroups = append(keepGroups, g)
				}
			}
		}
		s.Groups = keepGroups
		if err := os.RemoveAll(HomeDir); err != nil {
			errs = append(errs, err)
		}
		var keep []string
		for _, d := range s.Dirs {
			// Only if still empty: someone else may have started using it.
			if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
				keep = append(keep, d)
			}
		}
		s.Dirs = keep
		return errors.Join(errs...)
	})
}
