/* The raw-MPI peer of benches/comm.rs: MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM)
 * in a loop, as osu_allreduce times it, with the protocol benches/comm.rs uses for
 * tensorfleet's all-reduce, so that the two figures differ only in the call they time.
 *
 *     mpicc -O2 -o allreduce_peer allreduce_peer.c
 *     mpirun -np 2 allreduce_peer SECONDS REPS BYTES...
 *
 * Per buffer size: one checked all-reduce (rank r contributes r + 1), then the buffer is zeroed
 * (sums of zeros stay zero however often they are repeated), a warm-up, and an iteration count
 * from the slowest rank's time for a second round of warm-up calls (the same figure on every
 * rank, so that every rank makes the same calls). Then REPS timed loops, each after a barrier,
 * taking about SECONDS / REPS; a loop's time is the slowest rank's. MPI is initialised with MPI_THREAD_MULTIPLE, as the worker does.
 *
 * Rank 0 prints one JSON line:
 *   {"threading": "multiple", "library": "...", "sizes": [{"bytes": B, "iters": N, "seconds": S}, ...]}
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void all_reduce(float *buf, int n) {
    MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
}

/* Untimed calls before the timed ones: many for small buffers (whose first calls set up MPI's
 * paths), two for the largest (one call moves tens of megabytes). Shared with comm.rs. */
static long warm_up_calls(long bytes) {
    long k = (16L << 20) / bytes;
    return k < 2 ? 2 : k > 200 ? 200 : k;
}

static double max_over_ranks(double t) {
    double max;
    MPI_Allreduce(&t, &max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return max;
}

int main(int argc, char **argv) {
    int provided, rank, size;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc < 4) {
        if (rank == 0) fprintf(stderr, "usage: %s SECONDS REPS BYTES...\n", argv[0]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    double seconds = atof(argv[1]);
    int reps = atoi(argv[2]);
    int sizes = argc - 3;
    long largest = 0;
    for (int s = 0; s < sizes; s++) {
        long b = atol(argv[3 + s]);
        if (b <= 0 || b % 4 != 0 || b / 4 > 0x7fffffffL) {
            if (rank == 0) fprintf(stderr, "allreduce_peer: '%s' is not a size in bytes of f32 values\n", argv[3 + s]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        if (b > largest) largest = b;
    }
    if (seconds <= 0 || reps < 1) {
        if (rank == 0) fprintf(stderr, "allreduce_peer: SECONDS must be > 0 and REPS >= 1\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    float *buf = malloc(largest);
    if (!buf) {
        fprintf(stderr, "allreduce_peer: rank %d cannot allocate %ld bytes\n", rank, largest);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }

    char library[MPI_MAX_LIBRARY_VERSION_STRING];
    int len;
    MPI_Get_library_version(library, &len);
    for (char *c = library; *c; c++)
        if (*c == '"' || *c == '\\' || *c == '\n' || *c == '\t') *c = ' ';
    const char *levels[] = {"single", "funneled", "serialized", "multiple"};
    if (rank == 0)
        printf("{\"threading\": \"%s\", \"library\": \"%s\", \"sizes\": [",
               provided >= 0 && provided <= 3 ? levels[provided] : "?", library);

    for (int s = 0; s < sizes; s++) {
        long bytes = atol(argv[3 + s]);
        int n = (int)(bytes / 4);
        for (int i = 0; i < n; i++) buf[i] = (float)(rank + 1);
        all_reduce(buf, n);
        float expected = (float)size * (size + 1) / 2;
        for (int i = 0; i < n; i++) {
            if (buf[i] != expected) {
                fprintf(stderr, "allreduce_peer: rank %d, %ld bytes: value %d is %g, expected %g\n", rank, bytes, i,
                        buf[i], expected);
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
        }
        memset(buf, 0, bytes);

        long warm = warm_up_calls(bytes);
        for (long i = 0; i < warm; i++) all_reduce(buf, n);
        MPI_Barrier(MPI_COMM_WORLD);
        double t = MPI_Wtime();
        for (long i = 0; i < warm; i++) all_reduce(buf, n);
        double per_call = max_over_ranks(MPI_Wtime() - t) / warm;
        long iters = (long)(seconds / reps / per_call);
        if (iters < 2) iters = 2;
        if (iters > 1000000) iters = 1000000;

        double total = 0;
        for (int r = 0; r < reps; r++) {
            MPI_Barrier(MPI_COMM_WORLD);
            t = MPI_Wtime();
            for (long i = 0; i < iters; i++) all_reduce(buf, n);
            total += max_over_ranks(MPI_Wtime() - t);
        }
        if (rank == 0)
            printf("%s{\"bytes\": %ld, \"iters\": %ld, \"seconds\": %.9f}", s ? ", " : "", bytes, iters * reps, total);
    }
    if (rank == 0) printf("]}\n");
    free(buf);
    MPI_Finalize();
    return 0;
}
