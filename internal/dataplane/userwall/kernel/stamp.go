package kernel

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math/bits"
	"net/netip"
	"os"
	"strings"
	"syscall"
)

// The identity stamp (version 2) is sealed with SipHash-2-4 keyed by the
// cluster key. This file is the Go twin of the C: siphash and MACMessage
// must compute exactly what userwall.c does (TestStampMatchesKernel).

// StampVersion is the version byte of the stamps this build writes.
const StampVersion = 2

// WindowShift: the MAC covers the wall clock in windows of 2^35 ns (≈ 34 s);
// a stamp is accepted in the window before, at and after the receiver's.
const WindowShift = 35

// Key is one 128-bit cluster key.
type Key [16]byte

// ID is the 4-bit key id carried in each stamp (which key sealed it).
func (k Key) ID() uint8 {
	s := sha256.Sum256(k[:])
	return s[0] & 0x0f
}

func (k Key) halves() (uint64, uint64) {
	return binary.LittleEndian.Uint64(k[:8]), binary.LittleEndian.Uint64(k[8:])
}

// siphash is SipHash-2-4 of the little-endian words m (a message of 8*len(m)
// bytes).
func siphash(k Key, m []uint64) uint64 {
	k0, k1 := k.halves()
	v0 := 0x736f6d6570736575 ^ k0
	v1 := 0x646f72616e646f6d ^ k1
	v2 := 0x6c7967656e657261 ^ k0
	v3 := 0x7465646279746573 ^ k1
	round := func() {
		v0 += v1
		v1 = bits.RotateLeft64(v1, 13)
		v1 ^= v0
		v0 = bits.RotateLeft64(v0, 32)
		v2 += v3
		v3 = bits.RotateLeft64(v3, 16)
		v3 ^= v2
		v0 += v3
		v3 = bits.RotateLeft64(v3, 21)
		v3 ^= v0
		v2 += v1
		v1 = bits.RotateLeft64(v1, 17)
		v1 ^= v2
		v2 = bits.RotateLeft64(v2, 32)
	}
	for _, w := range m {
		v3 ^= w
		round()
		round()
		v0 ^= w
	}
	b := uint64(len(m)*8) << 56
	v3 ^= b
	round()
	round()
	v0 ^= b
	v2 ^= 0xff
	round()
	round()
	round()
	round()
	return v0 ^ v1 ^ v2 ^ v3
}

// Stamp is what a v2 stamp asserts about one packet.
type Stamp struct {
	Src, Dst     netip.Addr
	Sport, Dport uint16
	Proto        uint8
	UID, GID     uint32
	Window       uint64 // wall-clock ns >> WindowShift
	KeyID        uint8
}

// Meta is the stamp's meta byte: key id and the window's low 4 bits.
func (s Stamp) Meta() uint8 { return s.KeyID<<4 | uint8(s.Window&0xf) }

// MAC seals the stamp with k (the 64-bit tag, in the byte order the kernel
// writes it: little-endian).
func (s Stamp) MAC(k Key) uint64 {
	src, dst := s.Src.As16(), s.Dst.As16()
	m := []uint64{
		s.Window<<32 | uint64(StampVersion)<<24 | uint64(s.Meta())<<16 | uint64(s.Proto)<<8,
		uint64(s.UID)<<32 | uint64(s.GID),
		uint64(s.Sport)<<16 | uint64(s.Dport),
		binary.LittleEndian.Uint64(src[:8]), binary.LittleEndian.Uint64(src[8:]),
		binary.LittleEndian.Uint64(dst[:8]), binary.LittleEndian.Uint64(dst[8:]),
	}
	return siphash(k, m)
}

// Option is the 20 bytes of the stamp as carried in the IPv4 option and the
// IPv6 destination option (after their type and length bytes: 18 bytes of
// data in v6 follow the 2 bytes of type/len; here the common 18).
func (s Stamp) Option(k Key) []byte {
	b := make([]byte, 18)
	b[0] = StampVersion
	b[1] = s.Meta()
	binary.BigEndian.PutUint32(b[2:], s.UID)
	binary.BigEndian.PutUint32(b[6:], s.GID)
	binary.LittleEndian.PutUint64(b[10:], s.MAC(k))
	return b
}

// GenerateKeyBytes returns 16 random bytes.
func GenerateKeyBytes() []byte {
	k := make([]byte, 16)
	if _, err := rand.Read(k); err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return k
}

// GenerateKey returns a new random cluster key file body.
func GenerateKey() []byte {
	return []byte("# Palisade cluster key: the same file on every node, mode 0600, owner root.\n" +
		hex.EncodeToString(GenerateKeyBytes()) + "\n")
}

// ParseKeys reads a key file body: one or two keys of 32 hex digits, one per
// line ('#' comments and blank lines ignored). The first key seals stamps;
// every key listed is accepted (rotation: add the new key second on every
// node, then move it first, then remove the old one).
func ParseKeys(body []byte) ([]Key, error) {
	var keys []Key
	sc := bufio.NewScanner(bytes.NewReader(body))
	line := 0
	for sc.Scan() {
		line++
		t := strings.TrimSpace(sc.Text())
		if t == "" || strings.HasPrefix(t, "#") {
			continue
		}
		raw, err := hex.DecodeString(t)
		if err != nil || len(raw) != 16 {
			return nil, fmt.Errorf("line %d: want a key of 32 hex digits", line)
		}
		var k Key
		copy(k[:], raw)
		keys = append(keys, k)
	}
	switch {
	case len(keys) == 0:
		return nil, errors.New("no key in the file")
	case len(keys) > 2:
		return nil, fmt.Errorf("%d keys: at most 2 (the sealing key, and one more during a rotation)", len(keys))
	case len(keys) == 2 && keys[0].ID() == keys[1].ID():
		return nil, errors.New("the two keys have the same 4-bit id: generate another new key")
	}
	return keys, nil
}

// LoadKeys reads the cluster key file, refusing one that others may read.
func LoadKeys(path string) ([]Key, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if st.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("%s: mode %o: the cluster key must be readable by root only (chmod 600)", path, st.Mode().Perm())
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok && sys.Uid != 0 {
		return nil, fmt.Errorf("%s: owned by uid %d: the cluster key must be owned by root", path, sys.Uid)
	}
	body := make([]byte, 4096)
	n, err := f.Read(body)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	keys, err := ParseKeys(body[:n])
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return keys, nil
}
