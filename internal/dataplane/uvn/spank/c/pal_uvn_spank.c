/*
 * pal_uvn_spank.c — Palisade uvn SPANK plugin.
 *
 * Moves every job step (slurmstepd and so all its tasks) into the job
 * user's VRF (per-user VRF + VXLAN networks, see docs/uvn.md) and releases
 * the user's network when the step ends. The work is done by
 * `palisade uvn job start|end`; this plugin only calls it at the right
 * moments, from slurmstepd (remote context):
 *
 *   slurm_spank_init   (in slurmstepd, as root, before it connects back to
 *                       srun and before any task is forked)
 *       palisade --config CFG uvn job start UID --pid <slurmstepd> --holder <slurmstepd>
 *   slurm_spank_exit   (in slurmstepd, when the step ends)
 *       palisade --config CFG uvn job end UID --holder <slurmstepd>
 *
 * slurmstepd itself must be in the VRF: it connects back to srun, whose
 * listening sockets are in the user's VRF when srun runs in a session that
 * PAM moved there. Tasks inherit slurmstepd's cgroup, so they are covered.
 *
 * plugstack.conf (no path is compiled in):
 *
 *   required /usr/lib/palisade/pal_uvn_spank.so palisade=/usr/bin/palisade config=/etc/palisade/palisade.toml
 *
 * "required" + a non-zero return from slurm_spank_init fails the step when
 * its network cannot be set up: users never run outside their VRF.
 *
 * Build: gcc -Wall -Wextra -O2 -fPIC -shared -o pal_uvn_spank.so pal_uvn_spank.c
 * (headers from libslurm-dev).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <slurm/spank.h>

SPANK_PLUGIN(palisade_uvn, 1);

#define PLUGIN "palisade_uvn"

static char palisade_bin[PATH_MAX];
static char config_path[PATH_MAX];

/* parse_args reads palisade=PATH and config=PATH; both are required. */
static int parse_args(int ac, char **av)
{
	int i;

	palisade_bin[0] = config_path[0] = '\0';
	for (i = 0; i < ac; i++) {
		const char *v;
		char *dst;

		if (strncmp(av[i], "palisade=", 9) == 0) {
			v = av[i] + 9;
			dst = palisade_bin;
		} else if (strncmp(av[i], "config=", 7) == 0) {
			v = av[i] + 7;
			dst = config_path;
		} else {
			slurm_error(PLUGIN ": unknown argument \"%s\" (want palisade=PATH config=PATH)", av[i]);
			return -1;
		}
		if (v[0] != '/' || strlen(v) >= PATH_MAX) {
			slurm_error(PLUGIN ": %s: want an absolute path", av[i]);
			return -1;
		}
		strcpy(dst, v);
	}
	if (palisade_bin[0] == '\0' || config_path[0] == '\0') {
		slurm_error(PLUGIN ": plugstack.conf must give palisade=PATH and config=PATH");
		return -1;
	}
	return 0;
}

/*
 * run_palisade runs `palisade --config CFG uvn job ACTION UID [--pid P]
 * --holder H`, logs its output through Slurm and returns 0 only if it exited
 * with status 0. It waits for exactly its own child.
 */
static int run_palisade(const char *action, uid_t uid, pid_t pid, pid_t holder)
{
	char uid_s[32], pid_s[32], holder_s[32], buf[2048];
	char *argv[16];
	char *envp[] = { "PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL };
	int n = 0, fds[2], status, len = 0;
	ssize_t r;
	pid_t child, w;

	if (snprintf(uid_s, sizeof(uid_s), "%lu", (unsigned long)uid) >= (int)sizeof(uid_s) ||
	    snprintf(pid_s, sizeof(pid_s), "%ld", (long)pid) >= (int)sizeof(pid_s) ||
	    snprintf(holder_s, sizeof(holder_s), "%ld", (long)holder) >= (int)sizeof(holder_s)) {
		slurm_error(PLUGIN ": number formatting failed");
		return -1;
	}
	argv[n++] = palisade_bin;
	argv[n++] = "--config";
	argv[n++] = config_path;
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

	if (pipe2(fds, O_CLOEXEC) < 0) {
		slurm_error(PLUGIN ": pipe: %s", strerror(errno));
		return -1;
	}
	child = fork();
	if (child < 0) {
		slurm_error(PLUGIN ": fork: %s", strerror(errno));
		close(fds[0]);
		close(fds[1]);
		return -1;
	}
	if (child == 0) {
		int devnull = open("/dev/null", O_RDONLY);

		/*
		 * Leave slurmstepd's process group and ignore its end-of-step
		 * SIGTERM: the release at slurm_spank_exit must finish.
		 */
		if (setsid() < 0 || signal(SIGTERM, SIG_IGN) == SIG_ERR || signal(SIGHUP, SIG_IGN) == SIG_ERR)
			_exit(125);
		if (devnull < 0 || dup2(devnull, 0) < 0 || dup2(fds[1], 1) < 0 || dup2(fds[1], 2) < 0)
			_exit(126);
		execve(palisade_bin, argv, envp);
		/* Never return into slurmstepd's code from a forked copy. */
		dprintf(2, "exec %s: %s\n", palisade_bin, strerror(errno));
		_exit(127);
	}
	close(fds[1]);
	for (;;) {
		r = read(fds[0], buf + len, sizeof(buf) - 1 - len);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		len += r;
		if (len == (int)sizeof(buf) - 1) {
			/* Keep reading so the child never blocks on a full pipe. */
			char sink[512];

			while ((r = read(fds[0], sink, sizeof(sink))) > 0 || (r < 0 && errno == EINTR))
				;
			break;
		}
	}
	buf[len] = '\0';
	if (close(fds[0]) < 0)
		slurm_error(PLUGIN ": close: %s", strerror(errno));
	do {
		w = waitpid(child, &status, 0);
	} while (w < 0 && errno == EINTR);
	if (w != child) {
		slurm_error(PLUGIN ": waitpid %ld: %s", (long)child, strerror(errno));
		return -1;
	}
	if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
		if (len > 0)
			slurm_info(PLUGIN ": uvn job %s uid %s: %s", action, uid_s, buf);
		return 0;
	}
	if (WIFEXITED(status))
		slurm_error(PLUGIN ": uvn job %s uid %s failed (exit %d): %s", action, uid_s, WEXITSTATUS(status), buf);
	else
		slurm_error(PLUGIN ": uvn job %s uid %s killed by signal %d: %s", action, uid_s,
			    WIFSIGNALED(status) ? WTERMSIG(status) : -1, buf);
	return -1;
}

static int job_uid(spank_t sp, uid_t *uid)
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
	uid_t uid;

	/* Validate the arguments everywhere, act only in slurmstepd. */
	if (parse_args(ac, av) < 0)
		return spank_remote(sp) ? -1 : 0;
	if (!spank_remote(sp))
		return 0;
	if (job_uid(sp, &uid) < 0)
		return -1;
	return run_palisade("start", uid, getpid(), getpid());
}

int slurm_spank_exit(spank_t sp, int ac, char **av)
{
	uid_t uid;

	(void)ac;
	(void)av;
	if (!spank_remote(sp) || palisade_bin[0] == '\0')
		return 0;
	if (job_uid(sp, &uid) < 0)
		return -1;
	return run_palisade("end", uid, 0, getpid());
}
