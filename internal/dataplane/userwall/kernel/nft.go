package kernel

import (
	"context"
	"fmt"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// The tc ingress program cannot answer a packet itself; it marks a refused
// SYN or datagram and this table (in the node's netns) answers it at once with
// a TCP reset or ICMP administratively-prohibited instead of a silent drop
// that would leave MPI or ssh retrying.
const (
	NftTable = "palisade_userwall"
	// The marks tc ingress sets (enum uw_mark in bpf/userwall.c).
	MarkRST  = uint32(uwbpfUwMarkUW_MARK_RST)
	MarkICMP = uint32(uwbpfUwMarkUW_MARK_ICMP)
)

func rejectRules(t *nftables.Table, c *nftables.Chain) []*nftables.Rule {
	mark := func(m uint32) []expr.Any {
		return []expr.Any{
			&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(m)},
		}
	}
	rst := append(mark(MarkRST),
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
		&expr.Counter{},
		&expr.Reject{Type: unix.NFT_REJECT_TCP_RST, Code: unix.NFT_REJECT_TCP_RST})
	icmp := append(mark(MarkICMP),
		&expr.Counter{},
		&expr.Reject{Type: unix.NFT_REJECT_ICMPX_UNREACH, Code: unix.NFT_REJECT_ICMPX_ADMIN_PROHIBITED})
	return []*nftables.Rule{{Table: t, Chain: c, Exprs: rst}, {Table: t, Chain: c, Exprs: icmp}}
}

// InstallNft creates (or atomically refreshes) the reject table.
func InstallNft() error {
	cc, err := nftables.New()
	if err != nil {
		return err
	}
	t := &nftables.Table{Name: NftTable, Family: nftables.TableFamilyINet}
	tables, err := cc.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	exists := false
	for _, x := range tables {
		if x.Name == NftTable {
			exists = true
		}
	}
	cc.AddTable(t)
	pol := nftables.ChainPolicyAccept
	c := cc.AddChain(&nftables.Chain{
		Name: "input", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityRef(-5), Policy: &pol,
	})
	if exists {
		cc.FlushChain(c) // same batch: the rules are replaced atomically
	}
	for _, r := range rejectRules(t, c) {
		cc.AddRule(r)
	}
	if err := cc.Flush(); err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	return nil
}

// NftInstalled reports whether the reject table exists in this netns.
func NftInstalled() bool {
	cc, err := nftables.New()
	if err != nil {
		return false
	}
	tables, err := cc.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return false
	}
	for _, x := range tables {
		if x.Name == NftTable {
			return true
		}
	}
	return false
}

// RemoveNft deletes the reject table (absent: nothing to do).
func RemoveNft() error {
	if !NftInstalled() {
		return nil
	}
	cc, err := nftables.New()
	if err != nil {
		return err
	}
	cc.DelTable(&nftables.Table{Name: NftTable, Family: nftables.TableFamilyINet})
	return cc.Flush()
}

// NftComplete reports whether the reject table holds its chain and both
// rules (an administrator may flush a chain or delete a rule).
func NftComplete() bool {
	cc, err := nftables.New()
	if err != nil {
		return false
	}
	t := &nftables.Table{Name: NftTable, Family: nftables.TableFamilyINet}
	rules, err := cc.GetRules(t, &nftables.Chain{Name: "input", Table: t})
	return err == nil && len(rules) == 2
}

// WatchNft calls repair at once whenever a table, chain or rule is deleted
// in this namespace (an `nft flush ruleset`, a firewall service restart), and
// once after each (re)subscription; it returns when ctx ends. Safety does not
// depend on the table (the packets it would reject are dropped at the
// socket), only the manners of a refusal do.
func WatchNft(ctx context.Context, repair func()) {
	for ctx.Err() == nil {
		cc, err := nftables.New()
		var ch chan *nftables.MonitorEvent
		var mon *nftables.Monitor
		if err == nil {
			mon = nftables.NewMonitor(nftables.WithMonitorAction(nftables.MonitorActionDel),
				nftables.WithMonitorEventBuffer(64))
			ch, err = cc.AddMonitor(mon)
		}
		if err != nil {
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
				continue
			}
		}
		repair() // anything lost while not subscribed
	events:
		for {
			select {
			case <-ctx.Done():
				mon.Close()
				for range ch {
				}
				return
			case _, ok := <-ch:
				if !ok {
					break events // the subscription broke: subscribe again
				}
				for len(ch) > 0 {
					<-ch
				}
				repair()
			}
		}
		mon.Close()
	}
}
