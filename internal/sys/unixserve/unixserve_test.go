package unixserve

import (
	"bufio"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"
)

func dial(t *testing.T, path string) *net.UnixConn {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// ask sends a line and returns what the server wrote until it closed
// the connection (after the connection's claim on the bound ended).
func ask(t *testing.T, path, line string) string {
	t.Helper()
	c := dial(t, path)
	defer c.Close()
	c.Write([]byte(line + "\n"))
	b, _ := io.ReadAll(c)
	return string(b)
}

func TestListenModeAndReplace(t *testing.T) {
	path := filepath.Join(t.TempDir(), "d", "api.sock")
	for _, mode := range []os.FileMode{0o600, 0o666} {
		l, err := Listen(path, mode, -1)
		if err != nil {
			t.Fatal(err)
		}
		fi, err := os.Lstat(path)
		if err != nil || fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != mode {
			t.Fatalf("socket %v %v, want mode %v", fi.Mode(), err, mode)
		}
		// A second Listen replaces the socket; the first listener's Close
		// then leaves the new one alone.
		l2, err := Listen(path, mode, -1)
		if err != nil {
			t.Fatal(err)
		}
		l.Close()
		if _, err := os.Lstat(path); err != nil {
			t.Fatalf("the replaced listener's Close removed the new socket: %v", err)
		}
		l2.Close()
		if _, err := os.Lstat(path); err == nil {
			t.Fatal("Close left the socket")
		}
	}
	os.WriteFile(path, nil, 0o644)
	if _, err := Listen(path, 0o666, -1); err == nil {
		t.Fatal("Listen replaced a regular file")
	}
	if ents, _ := os.ReadDir(filepath.Dir(path)); len(ents) != 1 {
		t.Fatalf("left behind: %v", ents)
	}
}

func TestServe(t *testing.T) {
	path := filepath.Join(t.TempDir(), "api.sock")
	l, err := Listen(path, 0o600, -1)
	if err != nil {
		t.Fatal(err)
	}
	hold := make(chan struct{})
	var refuse atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		Serve(l, Options{Max: 1, Name: "test", Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
			Admit: func(*unix.Ucred) (func(), bool) { return func() {}, !refuse.Load() }},
			func(c *net.UnixConn, peer *unix.Ucred, release func()) {
				line, _ := bufio.NewReader(c).ReadString('\n')
				switch line {
				case "panic\n":
					panic("boom")
				case "hold\n":
					c.Write([]byte("held\n"))
					<-hold
				case "released\n":
					release()
					c.Write([]byte("released\n"))
					<-hold
				default:
					c.Write([]byte(line))
				}
				if peer.Uid != uint32(os.Getuid()) {
					t.Errorf("peer uid %d, want %d", peer.Uid, os.Getuid())
				}
			})
	}()
	if got := ask(t, path, "panic"); got != "" {
		t.Fatalf("a panicking handler answered %q", got)
	}
	if got := ask(t, path, "echo"); got != "echo\n" {
		t.Fatalf("after a panic: %q, want the server still serving", got)
	}
	// Max 1: while one connection is served, the next is closed at once.
	c := dial(t, path)
	c.Write([]byte("hold\n"))
	if s, _ := bufio.NewReader(c).ReadString('\n'); s != "held\n" {
		t.Fatalf("hold: %q", s)
	}
	if got := ask(t, path, "echo"); got != "" {
		t.Fatalf("over the bound: answered %q", got)
	}
	hold <- struct{}{}
	io.ReadAll(c) // closed after its claim ended
	c.Close()
	// A released connection no longer counts.
	c = dial(t, path)
	c.Write([]byte("released\n"))
	if s, _ := bufio.NewReader(c).ReadString('\n'); s != "released\n" {
		t.Fatalf("released: %q", s)
	}
	if got := ask(t, path, "echo"); got != "echo\n" {
		t.Fatalf("beside a released connection: %q", got)
	}
	hold <- struct{}{}
	io.ReadAll(c) // closed after its claim ended
	c.Close()
	refuse.Store(true)
	if got := ask(t, path, "echo"); got != "" {
		t.Fatalf("not admitted: answered %q", got)
	}
	l.Close()
	<-done
}
