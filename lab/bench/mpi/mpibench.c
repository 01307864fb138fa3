/*
 * palisade bench MPI program: ping-pong latency and bandwidth between
 * ranks 0 and 1 for each message size, then MPI_Allreduce over all ranks.
 * Compiled with mpicc by `palisade bench` at run time; prints one JSON
 * object per line on rank 0.
 *
 * usage: mpibench ITERS SIZE...
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int pattern(int i, int size) { return (i * 31 + size) & 0xff; }

int main(int argc, char **argv)
{
	int rank, nranks, iters, i, a, ok = 1;
	size_t maxsize = 8;

	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &nranks);
	if (argc < 3 || nranks < 2) {
		if (rank == 0)
			fprintf(stderr, "usage: mpirun -np N (N >= 2) %s ITERS SIZE...\n", argv[0]);
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	iters = atoi(argv[1]);
	if (iters < 1)
		iters = 1;
	for (a = 2; a < argc; a++)
		if ((size_t)atol(argv[a]) > maxsize)
			maxsize = (size_t)atol(argv[a]);
	char *buf = malloc(maxsize);
	if (buf == NULL)
		MPI_Abort(MPI_COMM_WORLD, 3);

	for (a = 2; a < argc; a++) {
		int size = atoi(argv[a]);
		int warm = iters / 10 + 2, n;
		double t0 = 0, t;
		for (i = 0; i < size; i++)
			buf[i] = rank == 0 ? (char)pattern(i, size) : 0;
		MPI_Barrier(MPI_COMM_WORLD);
		for (n = 0; n < warm + iters; n++) {
			if (n == warm)
				t0 = MPI_Wtime();
			if (rank == 0) {
				MPI_Send(buf, size, MPI_CHAR, 1, 1, MPI_COMM_WORLD);
				MPI_Recv(buf, size, MPI_CHAR, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			} else if (rank == 1) {
				MPI_Recv(buf, size, MPI_CHAR, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				MPI_Send(buf, size, MPI_CHAR, 0, 1, MPI_COMM_WORLD);
			}
		}
		t = MPI_Wtime() - t0;
		if (rank == 0) {
			/* rank 1 echoes what it received: the data must come back intact */
			for (i = 0; i < size; i++)
				if ((unsigned char)buf[i] != pattern(i, size))
					ok = 0;
			double lat = t / iters / 2 * 1e6; /* one way, microseconds */
			printf("{\"test\":\"pingpong\",\"size\":%d,\"iters\":%d,\"lat_us\":%.3f,\"bw_mb_s\":%.3f,\"ok\":%s}\n",
			       size, iters, lat, lat > 0 ? size / lat : 0, ok ? "true" : "false");
			fflush(stdout);
		}
	}

	int counts[2] = {1, 8192};
	double *sb = malloc(8192 * sizeof(double)), *rb = malloc(8192 * sizeof(double));
	for (a = 0; a < 2; a++) {
		int c = counts[a], n, warm = iters / 10 + 2;
		double t0 = 0, t, tmax;
		for (i = 0; i < c; i++)
			sb[i] = rank + 1;
		MPI_Barrier(MPI_COMM_WORLD);
		for (n = 0; n < warm + iters; n++) {
			if (n == warm)
				t0 = MPI_Wtime();
			MPI_Allreduce(sb, rb, c, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
		}
		t = (MPI_Wtime() - t0) / iters * 1e6;
		MPI_Reduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
		int good = 1;
		for (i = 0; i < c; i++)
			if (rb[i] != nranks * (nranks + 1) / 2.0)
				good = 0;
		if (rank == 0) {
			printf("{\"test\":\"allreduce\",\"size\":%d,\"ranks\":%d,\"iters\":%d,\"us\":%.3f,\"ok\":%s}\n",
			       (int)(c * sizeof(double)), nranks, iters, tmax, good ? "true" : "false");
			fflush(stdout);
		}
	}
	free(sb);
	free(rb);
	free(buf);
	MPI_Finalize();
	return ok ? 0 : 1;
}
