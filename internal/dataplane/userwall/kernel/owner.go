package kernel

import (
	"errors"

	"github.com/cilium/ebpf"
)

// SocketOwner is the owner record the programs keep for the socket fd
// (sk_owners): what every check of this socket will use. A TCP socket has
// one only once bound (post_bind; at socket() none is made: its checks read
// the credentials its file keeps, by the same rule), so it is what the
// checks use when the thread that created it bound it.
func (d *Dataplane) SocketOwner(fd int) (uid, gid uint32, err error) {
	var o uwbpfUwOwner
	if err := d.Map("sk_owners").Lookup(uint32(fd), &o); err != nil {
		return 0, 0, err
	}
	if o.Set == 0 {
		return 0, 0, errors.New("owner record not set")
	}
	return o.Uid, o.Gid, nil
}

// ExemptConnector reports whether the kernel's exempt connectors hold uid.
func (d *Dataplane) ExemptConnector(uid uint32) (bool, error) {
	var v uint8
	err := d.Map("exempt_conn").Lookup(uid, &v)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return false, nil
	}
	return err == nil, err
}
