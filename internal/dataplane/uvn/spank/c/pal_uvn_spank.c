/*
 * pal_uvn_spank.c — Palisade uvn SPANK plugin.
 *
 * Moves every job step (slurmstepd and so all its tasks) into the job
 * user's VRF (per-user VRF + VXLAN networks, see docs/uvn.md) and releases
 * exactly what the step took when it ends. The work is done by
 * `palisade uvn job start|end`; this plugin only calls it at the right
 * moments, from slurmstepd (remote context):
 *
 *   slurm_spank_init      (slurmstepd, root, before it connects back to srun
 *                          and before any task is forked)
 *       palisade --config CFG uvn job start UID --pid <slurmstepd> --holder <slurmstepd>
 *   slurm_spank_task_init (each task, before exec)
 *       if the start failed: print why on the task's stderr (srun's
 *       terminal, the batch job's output) and fail the task: user code never
 *       runs outside the VRF.
 *   slurm_spank_exit      (slurmstepd, when the step ends)
 *       palisade --config CFG uvn job end UID --holder <slurmstepd>
 *
 * A failed start does not fail slurm_spank_init itself: Slurm would then
 * report only "Plugin initialization failed" (and, with srun in a VRF, not
 * even that: its listener is reached only on SrunPortRange ports). The
 * step goes on until its tasks, where the reason reaches the user.
 *
 * The helper runs detached from slurmstepd (its own session, reparented to
 * init), so the end-of-step signals slurmstepd sends to its process tree
 * never cut a release short; it reports success with a last line
 * "palisade-uvn-job: ok" on the pipe, read with a deadline. Between fork and
 * exec only async-signal-safe calls are made (slurmstepd is threaded).
 *
 * plugstack.conf (no path is compiled in):
 *
 *   required /usr/lib/palisade/spank/pal_uvn_spank.so palisade=/usr/bin/palisade config=/etc/palisade/palisade.toml [timeout=30]
 *
 * Build: gcc -Wall -Wextra -O2 -fPIC -shared -o pal_uvn_spank.so pal_uvn_spank.c
 * (headers from libslurm-dev).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <slurm/spank.h>

SPANK_PLUGIN(palisade_uvn, 1);

#define PLUGIN "palisade_uvn"
#define JOB_OK "palisade-uvn-job: ok"
#define DEFAULT_TIMEOUT 30

static struct {
	char palisade[PATH_MAX];
	char config[PATH_MAX];
	int timeout; /* seconds, for each run of the helper */
} _opts;

/* Why the step's network could not be set up ("" = it was). */
static char _failure[2400];
/* The start ran (successfully or not): the end must release. */
static int _started;

/* _parse_args reads palisade=PATH, config=PATH and timeout=SECONDS. */
static int _parse_args(int ac, char **av)
{
	int i;

	_opts.palisade[0] = _opts.config[0] = '\0';
	_opts.timeout = DEFAULT_TIMEOUT;
	for (i = 0; i < ac; i++) {
		const char *v;
		char *dst;

		if (strncmp(av[i], "timeout=", 8) == 0) {
			char *end;
			long t = strtol(av[i] + 8, &end, 10);

			if (*end != '\0' || t < 1 || t > 3600) {
				slurm_error(PLUGIN ": %s: want seconds (1-3600)", av[i]);
				return -1;
			}
			_opts.timeout = (int)t;
			continue;
		}
		if (strncmp(av[i], "palisade=", 9) == 0) {
			v = av[i] + 9;
			dst = _opts.palisade;
		} else if (strncmp(av[i], "config=", 7) == 0) {
			v = av[i] + 7;
			dst = _opts.config;
		} else {
			slurm_error(PLUGIN ": unknown argument \"%s\" (want palisade=PATH config=PATH [timeout=SECONDS])", av[i]);
			return -1;
		}
		if (v[0] != '/' || strlen(v) >= PATH_MAX) {
			slurm_error(PLUGIN ": %s: want an absolute path", av[i]);
			return -1;
		}
		strcpy(dst, v);
	}
	if (_opts.palisade[0] == '\0' || _opts.config[0] == '\0') {
		slurm_error(PLUGIN ": plugstack.conf must give palisade=PATH and config=PATH");
		return -1;
	}
	return 0;
}

static long _now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

/* _fmt_ulong writes v in decimal into buf (async-signal-safe). */
static size_t _fmt_ulong(char *buf, unsigned long v)
{
	char tmp[24];
	size_t n = 0, i;

	do {
		tmp[n++] = (char)('0' + v % 10);
		v /= 10;
	} while (v && n < sizeof(tmp));
	for (i = 0; i < n; i++)
		buf[i] = tmp[n - 1 - i];
	return n;
}

/*
 * _child runs in the forked copy of slurmstepd: only async-signal-safe calls.
 * It leaves slurmstepd's session, forks the helper and exits at once, so the
 * helper is reparented to init and out of slurmstepd's process tree.
 */
static void _child(int devnull, int out, char **argv, char **envp)
{
	static const char msg[] = "palisade: cannot execute the palisade binary, errno ";
	char num[24];
	sigset_t none;
	pid_t helper;
	size_t n;

	if (setsid() < 0)
		_exit(125);
	helper = fork();
	if (helper < 0)
		_exit(126);
	if (helper > 0)
		_exit(0);
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	if (dup2(devnull, 0) < 0 || dup2(out, 1) < 0 || dup2(out, 2) < 0)
		_exit(126);
	/* None of slurmstepd's descriptors (srun's I/O sockets) may live on
	 * in the helper. */
	if (close_range(3, ~0U, 0) < 0) {
		int fd;

		for (fd = 3; fd < 4096; fd++)
			close(fd);
	}
	execve(argv[0], argv, envp);
	n = _fmt_ulong(num, (unsigned long)errno);
	num[n++] = '\n';
	if (write(2, msg, sizeof(msg) - 1) < 0 || write(2, num, n) < 0)
		_exit(127);
	_exit(127);
}

/*
 * _run_palisade runs `palisade --config CFG uvn job ACTION UID [--pid P]
 * --holder H` detached, collects its output into out (NUL-terminated) and
 * returns 0 if it reported success, -1 otherwise (why in out), -2 if it did
 * not finish within the timeout (then kill says whether to kill it).
 */
static int _run_palisade(const char *action, uid_t uid, pid_t pid, pid_t holder, int kill_late,
			 char *out, size_t outsz)
{
	char uid_s[32], pid_s[32], holder_s[32];
	char *argv[16];
	char *envp[] = { "PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL };
	int n = 0, fds[2], devnull, status, rc = -1;
	size_t len = 0;
	long deadline;
	pid_t child, w;

	out[0] = '\0';
	if (snprintf(uid_s, sizeof(uid_s), "%lu", (unsigned long)uid) >= (int)sizeof(uid_s) ||
	    snprintf(pid_s, sizeof(pid_s), "%ld", (long)pid) >= (int)sizeof(pid_s) ||
	    snprintf(holder_s, sizeof(holder_s), "%ld", (long)holder) >= (int)sizeof(holder_s)) {
		snprintf(out, outsz, "number formatting failed");
		return -1;
	}
	argv[n++] = _opts.palisade;
	argv[n++] = "--config";
	argv[n++] = _opts.config;
	argv[n++] = "uvn";
	argv[n++] = "job";
	argv[n++] = (char *)action;
	argv[n++] = uid_s;
	if (pid > 0) {
		argv[n++] = "--pid";
		argv[n++] = pid_s;
	}
	argv[n++] = "--holder";
	argv[n++] = holder_s;
	argv[n] = NULL;

	devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
	if (devnull < 0) {
		snprintf(out, outsz, "open /dev/null: %s", strerror(errno));
		return -1;
	}
	if (pipe2(fds, O_CLOEXEC) < 0) {
		snprintf(out, outsz, "pipe: %s", strerror(errno));
		close(devnull);
		return -1;
	}
	deadline = _now_ms() + _opts.timeout * 1000L;
	child = fork();
	if (child < 0) {
		snprintf(out, outsz, "fork: %s", strerror(errno));
		close(devnull);
		close(fds[0]);
		close(fds[1]);
		return -1;
	}
	if (child == 0)
		_child(devnull, fds[1], argv, envp);
	close(devnull);
	close(fds[1]);

	/* The intermediate child exits right after forking the helper. */
	for (;;) {
		w = waitpid(child, &status, WNOHANG);
		if (w == child || (w < 0 && errno != EINTR))
			break;
		if (_now_ms() >= deadline) {
			kill(child, SIGKILL);
			while (waitpid(child, &status, 0) < 0 && errno == EINTR)
				;
			break;
		}
		usleep(2000);
	}

	/* Read until the helper closes the pipe (it exited) or the deadline. */
	for (;;) {
		struct pollfd p = { .fd = fds[0], .events = POLLIN };
		long left = deadline - _now_ms();
		ssize_t r;
		char sink[512];

		if (left <= 0) {
			rc = -2;
			break;
		}
		r = poll(&p, 1, (int)left);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			snprintf(out, outsz, "poll: %s", strerror(errno));
			break;
		}
		if (r == 0)
			continue;
		if (len < outsz - 1)
			r = read(fds[0], out + len, outsz - 1 - len);
		else
			r = read(fds[0], sink, sizeof(sink)); /* never block the helper */
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0) {
			rc = 0;
			break;
		}
		if (len < outsz - 1)
			len += (size_t)r;
	}
	close(fds[0]);
	out[len] = '\0';
	if (rc == -2) {
		/* The helper leads its own process group (the intermediate
		 * child's session); its id stays reserved while the group lives. */
		if (kill_late)
			kill(-child, SIGKILL);
		return -2;
	}
	if (rc < 0)
		return -1;
	/* Success iff the last line is JOB_OK; drop it from the output. */
	while (len > 0 && out[len - 1] == '\n')
		out[--len] = '\0';
	if (len >= strlen(JOB_OK) && strcmp(out + len - strlen(JOB_OK), JOB_OK) == 0 &&
	    (len == strlen(JOB_OK) || out[len - strlen(JOB_OK) - 1] == '\n')) {
		len -= strlen(JOB_OK);
		while (len > 0 && out[len - 1] == '\n')
			len--;
		out[len] = '\0';
		return 0;
	}
	if (len == 0)
		snprintf(out, outsz, "the palisade helper ended without a result (killed?)");
	return -1;
}

/* _oneline turns the helper's output into one line: its error message
 * (after "palisade: "). */
static void _oneline(char *s)
{
	char *p = strstr(s, "palisade: ");

	if (p)
		memmove(s, p + 10, strlen(p + 10) + 1);
	for (p = s; *p; p++)
		if (*p == '\n')
			*p = ' ';
}

static int _job_uid(spank_t sp, uid_t *uid)
{
	spank_err_t rc = spank_get_item(sp, S_JOB_UID, uid);

	if (rc != ESPANK_SUCCESS) {
		slurm_error(PLUGIN ": S_JOB_UID: %s", spank_strerror(rc));
		return -1;
	}
	return 0;
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	char out[2048], host[256];
	uid_t uid;
	int rc;

	_failure[0] = '\0';
	_started = 0;
	if (gethostname(host, sizeof(host)) < 0)
		strcpy(host, "?");
	host[sizeof(host) - 1] = '\0';
	/* Validate the arguments everywhere, act only in slurmstepd. */
	if (_parse_args(ac, av) < 0) {
		if (!spank_remote(sp))
			return 0;
		snprintf(_failure, sizeof(_failure), "Palisade: %s: plugin misconfigured in plugstack.conf (see slurmd's log)", host);
		return 0;
	}
	if (!spank_remote(sp))
		return 0;
	if (_job_uid(sp, &uid) < 0) {
		snprintf(_failure, sizeof(_failure), "Palisade: %s: cannot tell the job's user", host);
		return 0;
	}
	if (uid == 0)
		return 0; /* root's steps stay in the default VRF */
	_started = 1;
	rc = _run_palisade("start", uid, getpid(), getpid(), 1, out, sizeof(out));
	if (rc == 0) {
		if (out[0])
			slurm_info(PLUGIN ": uvn job start uid %lu: %s", (unsigned long)uid, out);
		return 0;
	}
	if (rc == -2)
		snprintf(out, sizeof(out), "network setup did not finish within %d s (timeout=)", _opts.timeout);
	_oneline(out);
	snprintf(_failure, sizeof(_failure), "Palisade: %s: this step cannot run: %s", host, out);
	slurm_error(PLUGIN ": %s", _failure);
	return 0;
}

/* In each task, before exec: never run user code outside the VRF. */
int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	(void)sp;
	(void)ac;
	(void)av;
	if (_failure[0] == '\0')
		return 0;
	dprintf(2, "%s\n", _failure);
	slurm_error("%s", _failure);
	return -1;
}

int slurm_spank_exit(spank_t sp, int ac, char **av)
{
	char out[2048];
	uid_t uid;
	int rc;

	(void)ac;
	(void)av;
	if (!spank_remote(sp) || !_started)
		return 0;
	if (_job_uid(sp, &uid) < 0)
		return -1;
	rc = _run_palisade("end", uid, 0, getpid(), 0, out, sizeof(out));
	if (rc == 0)
		return 0;
	if (rc == -2) {
		/* Left running, detached: it finishes the release on its own. */
		slurm_error(PLUGIN ": uvn job end uid %lu: not done after %d s; left to finish in the background",
			    (unsigned long)uid, _opts.timeout);
		return 0;
	}
	_oneline(out);
	slurm_error(PLUGIN ": uvn job end uid %lu failed: %s", (unsigned long)uid, out);
	return -1;
}
