package attack

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"sync"
	"time"
)

// actors keeps one long-lived `probe act --serve` process per node and
// user for the whole suite, and runs every step of that user there. In the
// uvn VM every command of a user is a login (its setup attaches the
// session's programs: seconds under emulation) and every process start a
// Go start over 9p; the steps themselves are milliseconds. A step's
// sockets are made by the same kind of process in the same place (the
// user's login, the stray process's setpriv) as with a process per step.
type actors struct {
	ctx context.Context
	mu  sync.Mutex
	m   map[string]*actor
}

type actor struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string // stdout, a result per step; closed at EOF
	err   strings.Builder
}

func newActors(ctx context.Context) *actors {
	return &actors{ctx: ctx, m: map[string]*actor{}}
}

// pooled: "unshare:…" steps run in namespaces of their own, each apart.
func pooled(user string) bool { return !strings.HasPrefix(user, "unshare:") }

// act runs spec as user on node in that user's actor (started on first
// use); a dead or stuck actor is replaced on the next step.
func (p *actors) act(e *Env, node, user string, spec ActSpec, wait time.Duration) (ActResult, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	key := node + "/" + user
	a := p.m[key]
	if a == nil {
		var err error
		if a, err = startActor(p.ctx, e, node, user); err != nil {
			return ActResult{}, err
		}
		p.m[key] = a
	}
	b, _ := json.Marshal(spec)
	var res ActResult
	if _, err := a.stdin.Write(append(b, '\n')); err != nil {
		a.stop()
		delete(p.m, key)
		return res, fmt.Errorf("act %s@%s: %v: %s", user, node, err, strings.TrimSpace(a.err.String()))
	}
	select {
	case l, ok := <-a.lines:
		if !ok {
			a.stop()
			delete(p.m, key)
			return res, fmt.Errorf("act %s@%s: the actor ended: %s", user, node, strings.TrimSpace(a.err.String()))
		}
		if err := json.Unmarshal([]byte(l), &res); err != nil {
			return res, fmt.Errorf("act %s@%s: %v: %s", user, node, err, l)
		}
		return res, nil
	case <-time.After(wait):
		a.stop()
		delete(p.m, key)
		return res, fmt.Errorf("act %s@%s: no result within %v", user, node, wait)
	}
}

func startActor(ctx context.Context, e *Env, node, user string) (*actor, error) {
	a := &actor{lines: make(chan string, 1)}
	a.cmd = e.command(ctx, node, user, e.TB.LabBinary, "probe", "act", "--serve")
	a.cmd.Stderr = &a.err
	a.cmd.WaitDelay = 2 * time.Second
	var err error
	if a.stdin, err = a.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	out, err := a.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := a.cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			a.lines <- sc.Text()
		}
		close(a.lines)
	}()
	return a, nil
}

// stop ends the actor: stdin closed, then killed if it does not exit.
func (a *actor) stop() {
	a.stdin.Close()
	done := make(chan struct{})
	go func() { a.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(3 * time.Second):
		a.cmd.Process.Kill()
		<-done
	}
	for range a.lines {
	}
}

// close stops every actor.
func (p *actors) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	var wg sync.WaitGroup
	for k, a := range p.m {
		wg.Add(1)
		go func() { defer wg.Done(); a.stop() }()
		delete(p.m, k)
	}
	wg.Wait()
}

// ServeActs runs one step per line of specs (JSON ActSpec) and writes each
// result as a line (`probe act --serve`), until specs ends.
func ServeActs(specs io.Reader, out io.Writer) error {
	sc := bufio.NewScanner(specs)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	enc := json.NewEncoder(out)
	for sc.Scan() {
		var s ActSpec
		var r ActResult
		if err := json.Unmarshal(sc.Bytes(), &s); err != nil {
			r.Error = "bad spec: " + err.Error()
		} else if s.LoopMS > 0 || s.Creds != nil {
			r.Error = "loops and steps taking other ids are not served (a process per step)"
		} else {
			r = Act(s)
		}
		if err := enc.Encode(r); err != nil {
			return err
		}
	}
	if err := sc.Err(); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	return nil
}
