// Package userwall is the userwall data plane's lab adapter: the testbed mode
// that runs `palisade agent` on every node, and the behaviour tests that drive
// it; the data plane itself is internal/dataplane/userwall.
package userwall

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/control"
	"github.com/palisade-hpc/palisade/internal/sys/pidfd"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// TestbedMode is the "userwall" testbed mode: `palisade agent` on every node,
// started as a site would run it (a daemon in the node's network namespace
// with the node's configuration, pid file and event log), and uninstalled
// on down.
type TestbedMode struct{}

// ModeName is the testbed mode (and check and bench mode) of userwall.
const ModeName = "userwall"

// Up starts the agents.
func (TestbedMode) Up(ctx context.Context, tb *testbed.Testbed) error { return StartAgents(ctx, tb) }

// Down stops the agents and removes everything they made.
func (TestbedMode) Down(ctx context.Context, tb *testbed.Testbed) error { return StopAgents(ctx, tb) }

// nodeCommand runs the palisade binary in a node's network and UTS
// namespaces but in the caller's mount namespace: `ip netns exec` would give
// it a fresh sysfs without the host's bpffs and cgroup2 mounts, where pins
// would be invisible to the next command (restart, uninstall).
//
// The agent (and its --reload, systemd's ExecReload=) runs as the shipped
// unit runs it: its capabilities and sandboxing (UnitSandbox), so that
// whatever the unit forbids fails here too.
func nodeCommand(ctx context.Context, tb *testbed.Testbed, n testbed.Node, args ...string) *exec.Cmd {
	// With a directory, the node's accounts view (its passwd, group,
	// nsswitch.conf and SSSD) in a mount namespace of its own.
	argv := append([]string{"--net=/run/netns/" + n.NetNS, "--uts=" + n.UTS, "--"}, tb.IdentityPrefix(n.Name)...)
	if len(args) > 0 && args[0] == "agent" && !slices.Contains(args, "--uninstall") {
		u, err := AgentUnit()
		if err != nil {
			panic("palisade-agent.service: " + err.Error()) // a unit the lab cannot run is a bug of this change
		}
		prefix, err := u.Prefix(tb.LabBinary)
		if err != nil {
			panic("palisade-agent.service: " + err.Error()) // idem: its system call filter cannot be built here
		}
		argv = append(argv, prefix...)
	}
	argv = append(append(argv, tb.Binary), args...)
	argv = append(argv, "--config", tb.ConfigPath(n.Name))
	cmd := exec.CommandContext(ctx, "nsenter", argv...)
	// The node's /etc/slurm/slurm.conf (the agent checks Slurm's accounts
	// in it) is the testbed's: the agent runs in the host's mount namespace.
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "SLURM_CONF=" + tb.SlurmConf()}
	return cmd
}

// AgentPidFile is the node's agent pid file (from its configuration).
func AgentPidFile(tb *testbed.Testbed, node string) string {
	if c, err := config.Load(tb.ConfigPath(node)); err == nil {
		return c.Agent.PidFile
	}
	return filepath.Join(tb.RunDir(), node, "agent.pid")
}

// StartAgent starts the agent of one node and waits until it enforces.
func StartAgent(ctx context.Context, tb *testbed.Testbed, n testbed.Node) error {
	return StartAgentEnv(ctx, tb, n, nil)
}

// StartAgentEnv is StartAgent with env (KEY=value) added to the agent's
// environment (test settings such as userwall.TestPeerTTLEnv).
func StartAgentEnv(ctx context.Context, tb *testbed.Testbed, n testbed.Node, env []string) error {
	pidFile := AgentPidFile(tb, n.Name)
	if pid := control.ReadPid(pidFile); pid != 0 {
		return nil // already running
	}
	if err := os.MkdirAll(filepath.Dir(pidFile), 0o755); err != nil {
		return err
	}
	logPath := filepath.Join(tb.LogDir(), n.Name+"-agent.log")
	logf, err := os.OpenFile(logPath, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	// Not tied to ctx: the daemon outlives `testbed up`.
	cmd := nodeCommand(context.Background(), tb, n, "agent")
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("%s: start agent: %w", n.Name, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	// Under emulation (the VM testbed: PALISADE_VM=1) three agents probe the
	// kernel and load their programs through the verifier at once, at
	// TCG speed: minutes, not seconds.
	ready := 30 * time.Second
	if os.Getenv("PALISADE_VM") == "1" {
		ready = 5 * time.Minute
	}
	deadline := time.NewTimer(ready)
	defer deadline.Stop()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-exited:
			return fmt.Errorf("%s: agent exited (%v): %s", n.Name, err, tail(logPath))
		case <-deadline.C:
			_ = cmd.Process.Kill()
			return fmt.Errorf("%s: agent not ready after %v: %s", n.Name, ready, tail(logPath))
		case <-ctx.Done():
			_ = cmd.Process.Kill()
			return ctx.Err()
		case <-tick.C:
			if control.ReadPid(pidFile) == cmd.Process.Pid {
				return nil
			}
		}
	}
}

func tail(path string) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 5 {
		lines = lines[len(lines)-5:]
	}
	return strings.Join(lines, "\n")
}

// StopAgent stops one node's agent and removes its programs, pins and nft
// table (`palisade agent --uninstall` in the node).
func StopAgent(ctx context.Context, tb *testbed.Testbed, n testbed.Node) error {
	out, err := nodeCommand(ctx, tb, n, "agent", "--uninstall").CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: uninstall: %v: %s", n.Name, err, out)
	}
	return nil
}

// agentStopBound bounds SignalAgent's wait: an agent stops in well under a
// second; the bound only turns a hang into an error.
const agentStopBound = time.Minute

// TermAgent stops one node's agent as systemd does (SIGTERM): its programs
// stay pinned and go on enforcing, and the next agent adopts them. It
// returns once the agent has exited (at once if none runs), waiting on the
// process itself (pidfd.Signal), not polling its pid file.
func TermAgent(tb *testbed.Testbed, node string) error {
	return SignalAgent(tb, node, unix.SIGTERM)
}

// SignalAgent sends sig (SIGTERM, SIGKILL) to one node's agent and returns
// once it has exited (at once if none runs).
func SignalAgent(tb *testbed.Testbed, node string, sig unix.Signal) error {
	pid := control.ReadPid(AgentPidFile(tb, node))
	if pid == 0 {
		return nil
	}
	exited, err := pidfd.Signal(pid, sig, agentStopBound)
	if err != nil {
		return fmt.Errorf("%s: agent: %w", node, err)
	}
	if !exited {
		return fmt.Errorf("%s: agent %d did not stop within %v of %v", node, pid, agentStopBound, sig)
	}
	return nil
}

// StartAgents starts the agent on every node; on failure the ones started
// are removed again.
func StartAgents(ctx context.Context, tb *testbed.Testbed) error {
	err := testbed.Parallel(tb.Nodes, func(n testbed.Node) error {
		if !tb.Enforcing(n.Name) {
			return nil // staged rollout (testbed up --agents): not yet
		}
		return StartAgent(ctx, tb, n)
	})
	if err != nil {
		_ = StopAgents(context.Background(), tb)
	}
	return err
}

// StopAgents uninstalls the agent on every node.
func StopAgents(ctx context.Context, tb *testbed.Testbed) error {
	return testbed.Parallel(tb.Nodes, func(n testbed.Node) error { return StopAgent(ctx, tb, n) })
}

// NodeCommand runs the product binary in a node as the agent's site units
// would (see nodeCommand), for tests of other packages.
func NodeCommand(ctx context.Context, tb *testbed.Testbed, n testbed.Node, args ...string) *exec.Cmd {
	return nodeCommand(ctx, tb, n, args...)
}
