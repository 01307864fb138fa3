package userwall

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/sys/netns"
	"github.com/palisade-hpc/palisade/lab/check"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// SettleCheck (check.Settler of mode userwall) waits until each listener node's agent has loaded the
// membership the check's shared-group cases rely on: a listener under a
// supplementary group (sg proj1) is only known to the agent once it runs,
// and its group's member list is looked up then (membership.Tracker).
func SettleCheck(ctx context.Context, tb *testbed.Testbed, cases []*check.Case) error {
	want := map[string]map[MemberPair]bool{}
	for _, c := range cases {
		if c.Expected.Rule != string(policy.RuleSharedGroup) || c.Connector.GID == c.Listener.GID {
			continue
		}
		if _, ok := tb.Node(c.Listener.Node); !ok || c.Listener.Node == "outside" {
			continue
		}
		if want[c.Listener.Node] == nil {
			want[c.Listener.Node] = map[MemberPair]bool{}
		}
		want[c.Listener.Node][MemberPair{UID: c.Connector.UID, GID: c.Listener.GID}] = true
	}
	var errs []error
	for node, set := range want {
		pairs := make([]MemberPair, 0, len(set))
		for p := range set {
			pairs = append(pairs, p)
		}
		errs = append(errs, WaitMembers(ctx, tb, node, pairs, 30*time.Second))
	}
	return errors.Join(errs...)
}

// nodeCookie is the netns cookie of a testbed node (its agent's pin dir).
func nodeCookie(n testbed.Node) (c uint64, err error) {
	err = netns.DoPath("/run/netns/"+n.NetNS, func() (err error) {
		c, err = kernel.NetnsCookie()
		return err
	})
	return c, err
}

// MemberPair is one (uid, gid) entry of the kernel's membership map.
type MemberPair = kernel.MemberPair

// WaitMembers waits until the members map the agent of node loaded holds
// every pair: the agent's acknowledgement that what it learns from new
// listeners (their groups' member lists) is in force.
func WaitMembers(ctx context.Context, tb *testbed.Testbed, node string, pairs []MemberPair, timeout time.Duration) error {
	n, ok := tb.Node(node)
	if !ok {
		return fmt.Errorf("no node %s", node)
	}
	cookie, err := nodeCookie(n)
	if err != nil {
		return err
	}
	fs := "/sys/fs/bpf"
	if c, err := config.Load(tb.ConfigPath(node)); err == nil {
		fs = c.Agent.BPFFS
	}
	pinDir := kernel.PinDir(fs, cookie)
	deadline := time.Now().Add(timeout)
	for {
		missing, err := kernel.MissingMembers(pinDir, pairs)
		if err == nil && len(missing) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			if err == nil {
				err = fmt.Errorf("missing %v", missing)
			}
			return fmt.Errorf("%s: members map after %v: %w", node, timeout, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// NodePinDir is the pin directory of node's agent (from the host).
func NodePinDir(tb *testbed.Testbed, node string) (string, error) {
	n, ok := tb.Node(node)
	if !ok {
		return "", fmt.Errorf("no node %s", node)
	}
	cookie, err := nodeCookie(n)
	if err != nil {
		return "", err
	}
	fs := "/sys/fs/bpf"
	if c, err := config.Load(tb.ConfigPath(node)); err == nil {
		fs = c.Agent.BPFFS
	}
	return kernel.PinDir(fs, cookie), nil
}

// WaitKnown waits until node's agent has (want) or has not (!want) looked
// uid up: the known-users map it loaded holds uid.
func WaitKnown(ctx context.Context, tb *testbed.Testbed, node string, uid uint32, want bool, timeout time.Duration) error {
	pinDir, err := NodePinDir(tb, node)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(timeout)
	for {
		got, err := kernel.KnowsUser(pinDir, uid)
		if err == nil && got == want {
			return nil
		}
		if time.Now().After(deadline) {
			if err == nil {
				err = fmt.Errorf("known = %v", got)
			}
			return fmt.Errorf("%s: uid %d in known_users after %v: %w", node, uid, timeout, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}
