package check

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Queued is an srun whose job waits in the queue before it starts, as most
// interactive jobs on a real cluster do: the allocation is granted later,
// by slurmctld calling back into srun's listener (which must therefore be
// reachable from the controller whatever network srun runs in).
const Queued Launcher = "queued"

// queuedMark is what srun prints when its job has to wait.
const queuedMark = "queued and waiting for resources"

// runQueued occupies p's node with an exclusive root job, starts the srun,
// and lets the blocker end only once srun has said that its job is queued:
// the wait is certain and no longer than needed.
func (r *runner) runQueued(ctx context.Context, p *proc) {
	host := p.Hosts[0]
	flag := filepath.Join(r.outDir(), p.tag+".release")
	release := func() { os.WriteFile(flag, nil, 0o644) }
	defer release()

	// The blocker: an exclusive job on the node, until the flag exists.
	out, err := r.tb.Command(ctx, p.Start, "", "sbatch", "--parsable", "--job-name="+r.jobName(), "--exclusive",
		"-N1", "-w", host, "-o", "/dev/null", "--wrap",
		"while [ ! -e "+shellJoin([]string{flag})+" ]; do sleep 0.1; done").CombinedOutput()
	blocker, _, _ := strings.Cut(strings.TrimSpace(string(out)), ";")
	if err != nil || blocker == "" {
		p.failure = fmt.Sprintf("queued: blocker job on %s: %v %s", host, err, summarize(string(out), 3))
		return
	}
	defer func() {
		c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		r.tb.Command(c, p.Start, "", "scancel", blocker).Run()
	}()
	if err := r.waitRunning(ctx, p.Start, blocker); err != nil {
		p.failure = fmt.Sprintf("queued: blocker job %s on %s never ran: %v", blocker, host, err)
		return
	}

	cmd := r.tb.Command(ctx, p.Start, asUser(p.User), append([]string{"srun", "--job-name=" + r.jobName(),
		"-N1", "-n1", "-w", host}, r.connectArgv(p)...)...)
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 5 * time.Second
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	var buf strings.Builder
	var mu sync.Mutex
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(pr)
		released := false
		for sc.Scan() {
			mu.Lock()
			buf.WriteString(sc.Text() + "\n")
			mu.Unlock()
			if !released && strings.Contains(sc.Text(), queuedMark) {
				release() // srun's job is in the queue: let the node go
				released = true
			}
		}
		io.Copy(io.Discard, pr)
	}()
	err = cmd.Start()
	if err == nil {
		err = cmd.Wait()
	}
	pw.Close()
	<-done
	mu.Lock()
	p.output = buf.String()
	mu.Unlock()
	if err != nil {
		p.failure = fmt.Sprintf("%s as %s on %s: %v %s", p.Launcher, p.User, p.Start, err, summarize(p.output, 3))
	}
}

// waitRunning polls Slurm until job is running (bounded by ctx).
func (r *runner) waitRunning(ctx context.Context, node, job string) error {
	for {
		out, err := r.tb.Command(ctx, node, "", "squeue", "-h", "-j", job, "-o", "%T").CombinedOutput()
		state := strings.TrimSpace(string(out))
		switch {
		case err == nil && state == "RUNNING":
			return nil
		case err == nil && state == "":
			return fmt.Errorf("job %s left the queue", job)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// checkQueued verifies that p's connector ran in a Slurm step whose job
// really waited in the queue.
func (p *proc) checkQueued(env map[string]string) error {
	if _, ok := env["SLURM_JOB_ID"]; !ok {
		return fmt.Errorf("not in a Slurm step (environment %v)", env)
	}
	if !strings.Contains(p.output, queuedMark) {
		return fmt.Errorf("the job did not wait in the queue (srun did not say %q)", queuedMark)
	}
	return nil
}
