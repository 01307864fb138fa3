package gateway

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
)

// natTable is the gateway's nftables table for tun (one per tun: gateways
// with different tuns may share a host).
func natTable(tunName string) *nftables.Table {
	return &nftables.Table{Name: "palisade_egress_" + strings.ReplaceAll(tunName, "-", "_"), Family: nftables.TableFamilyIPv4}
}

// installNAT (re)creates, in one transaction, the table that masquerades
// the client pool out of every device but the tun:
//
//	postrouting (nat): ip saddr <pool> oifname != <tun> masquerade
func installNAT(tunName string, pool netip.Prefix) error {
	if !pool.Addr().Is4() {
		return fmt.Errorf("pool %s: the gateway NATs IPv4 only", pool)
	}
	c, err := nftables.New()
	if err != nil {
		return err
	}
	t := natTable(tunName)
	// Add, delete, add in one batch: an old table (a crashed gateway's) is
	// replaced atomically, and a missing one is no error.
	c.AddTable(t)
	c.DelTable(t)
	c.AddTable(t)
	accept := nftables.ChainPolicyAccept
	post := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource, Policy: &accept})
	p := pool.Masked()
	mask := make([]byte, 4)
	for i := range p.Bits() {
		mask[i/8] |= 0x80 >> (i % 8)
	}
	dev := make([]byte, 16) // IFNAMSIZ, zero-padded as the kernel compares it
	copy(dev, tunName)
	c.AddRule(&nftables.Rule{Table: t, Chain: post, Exprs: []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4}, // saddr
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: p.Addr().AsSlice()},
		&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: dev},
		&expr.Masq{},
	}})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables table %s: %w", t.Name, err)
	}
	return nil
}

// removeNAT deletes the table; a missing one is fine.
func removeNAT(tunName string) error {
	c, err := nftables.New()
	if err != nil {
		return err
	}
	t := natTable(tunName)
	c.AddTable(t) // makes the delete succeed when the table is absent
	c.DelTable(t)
	return c.Flush()
}

const ipForward = "/proc/sys/net/ipv4/ip_forward"

// forwardJournal holds ip_forward's value from before the gateway set it,
// until the gateway restores it: a gateway that died without restoring
// leaves it for the next one, which restores the host's own value, not
// the one it finds.
func forwardJournal(stateDir string) string { return filepath.Join(stateDir, "ip_forward.orig") }

// enableForwarding turns IPv4 forwarding on, journaled; restore puts the
// value from before back.
func enableForwarding(stateDir string) (restore func() error, err error) {
	j := forwardJournal(stateDir)
	orig, err := os.ReadFile(j)
	if errors.Is(err, os.ErrNotExist) {
		if orig, err = os.ReadFile(ipForward); err != nil {
			return nil, err
		}
		if err := os.WriteFile(j+".tmp", orig, 0o600); err != nil {
			return nil, err
		}
		if err := os.Rename(j+".tmp", j); err != nil {
			return nil, err
		}
	} else if err != nil {
		return nil, err
	}
	restore = func() error {
		if err := os.WriteFile(ipForward, orig, 0); err != nil {
			return fmt.Errorf("restore %s to %s: %w", ipForward, strings.TrimSpace(string(orig)), err)
		}
		return os.Remove(j)
	}
	if err := os.WriteFile(ipForward, []byte("1"), 0); err != nil {
		return nil, errors.Join(fmt.Errorf("enable forwarding: %w", err), restore())
	}
	return restore, nil
}
