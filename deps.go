//go:build tools

// This file pins the libraries Palisade is built from in go.mod, so that
// packages developed in parallel do not race to edit it. It is never compiled.
package palisade

import (
	_ "github.com/BurntSushi/toml"
	_ "github.com/cilium/ebpf"
	_ "github.com/cilium/ebpf/cmd/bpf2go"
	_ "github.com/google/nftables"
	_ "github.com/mdlayher/netlink"
	_ "github.com/miekg/dns"
	_ "github.com/prometheus/client_golang/prometheus"
	_ "github.com/spf13/cobra"
	_ "github.com/vishvananda/netlink"
	_ "github.com/vishvananda/netns"
	_ "golang.zx2c4.com/wireguard/device"
	_ "golang.zx2c4.com/wireguard/tun/netstack"
	_ "gonum.org/v1/plot"
)
