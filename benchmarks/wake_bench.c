/* What waking N children costs the waker, by wake-up mechanism (issue 16).
 *
 *     wake_bench MODE SCHED N ROUNDS
 *
 * Built and run by benchmarks/bench_wake.py; no boltzlabs, no sandbox, no Python.
 * A parent forks N children and runs ROUNDS rounds (after a warm-up) of the
 * worker's step in miniature: wake every child; each child answers with one
 * 16-byte write to its own reply pipe; the parent waits in epoll, napping
 * between waits as native/fastpath.c's nap() does, and reads every reply.
 * MODE is how the parent wakes the children (and, in the shm modes, how the
 * replies come back):
 *
 *     pipe        one 16-byte write per child to its request pipe (today's channel)
 *     futex       a futex word per child in shared memory: a store and one FUTEX_WAKE per child
 *     bcast       one shared word: one store and one FUTEX_WAKE(INT_MAX) for all
 *                 (the requests themselves would travel in shared memory)
 *     pipe+bcast  a write per child to a pipe nobody sleeps on, then one broadcast wake;
 *                 each child reads its pipe non-blocking once woken
 *     uring       the per-child pipe writes of a round submitted by one io_uring_enter
 *     shm         the whole channel in shared memory: each request written into its
 *                 child's request slot, one broadcast wake (as bcast); each child
 *                 writes its reply into its own reply slot (payload, then a release
 *                 store of the slot's sequence word) and no pipe exists. The parent
 *                 makes no system call per child: it naps (nanosleep, nap()'s rule
 *                 but never shorter than NAP_MIN) and scans the sequence words
 *                 (acquire loads), copying each new reply out once
 *     shm+wake    as shm, but a child that has replied also bumps a doorbell word
 *                 and does FUTEX_WAKE(1) on it; the parent sleeps in FUTEX_WAIT on
 *                 the doorbell instead of napping blind, scans after every wake,
 *                 and lets at least NAP_MIN pass between two scans
 *
 * SCHED is the children's policy: other (SCHED_OTHER) or batch (SCHED_BATCH,
 * which the scheduler does not let preempt a running task on wake-up).
 *
 * Output, one JSON line on stdout: the parent's user and system CPU per
 * child-round (getrusage over the timed rounds), the children's (each child's
 * RUSAGE_THREAD over the same window, summed), the part of the parent's CPU
 * spent waking (writing the requests and the wake-up calls, by its thread CPU
 * clock around them: parent_wake_us), child-rounds per second and the
 * parent's waits per round: epoll waits, or in the shm modes its sleeps
 * (nanosleep and FUTEX_WAIT calls); and the replies it accepted in the timed
 * rounds (N * ROUNDS when every child answered every round). Exit status: 0;
 * 1 on an error (said on stderr); 2 for a usage error; 3 when MODE cannot run
 * here (io_uring_setup refused: containers often forbid it).
 *
 * Process hygiene: the children run in a process group of their own, die with
 * the parent (PR_SET_PDEATHSIG), and leave at the end by the mode's own stop
 * (end of file on their pipe, or a STOP value in their word). On any error,
 * SIGINT, SIGTERM or SIGHUP the parent kills that group and reaps it, and the
 * final reaping has a deadline, so no child outlives the benchmark.
 *
 * The reply slots are written by the children: the parent treats them as
 * untrusted. A sequence word that is neither this round's nor the last, a
 * payload that is not the expected 16 bytes, or a child that has not answered
 * by the round's deadline (or has exited: checked once a round is slow) ends
 * the run with the child named. For the tests of those checks, the variable
 * WAKE_BENCH_FAULT=CHILD:KIND (KIND seq or payload) makes child CHILD write a
 * bad sequence word or payload in the shm modes, and WAKE_BENCH_ROUND_DEADLINE
 * (seconds, 0.1-3600) shortens the round's deadline for a test that waits for
 * it; nothing else reads them. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <linux/io_uring.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum mode { PIPE, FUTEX, BCAST, PIPE_BCAST, URING, SHM, SHM_WAKE };
static const char *const MODE_NAMES[] = {"pipe", "futex", "bcast", "pipe+bcast", "uring", "shm", "shm+wake"};

#define MSG_SIZE 16
static const char MSG[MSG_SIZE + 1] = "0123456789abcdef";
#define STOP 0xffffffffu          /* a futex word's value that tells children to exit */
static double ROUND_DEADLINE = 10.0; /* seconds a round may take before the run is called hung */
#define EXIT_DEADLINE 5.0         /* seconds the children have to exit at the end */
#define MAX_N 100000
#define LIVENESS_AFTER 0.1        /* shm modes: a round this slow (s) checks for exited children */

/* The fan-in's nap, as native/fastpath.c's nap(): between two epoll waits,
 * while more than NAP_MIN_WAITING children are still out, sleep an eighth of
 * the time the fan-in has taken so far (at most 1 ms), so replies pile up and
 * are read after one wake-up instead of one each. The shm mode has no epoll to
 * sleep in, so it always naps, at least NAP_MIN. NAP_DIVISOR can be set at
 * build time (cc -DNAP_DIVISOR=2; bench_wake.py --nap-divisor). */
#define NAP_MIN_WAITING 8
#ifndef NAP_DIVISOR
#define NAP_DIVISOR 8.0
#endif
#define NAP_MAX 0.001
#define NAP_MIN 0.00001

/* Shared memory (MAP_SHARED, so one page cache object for parent and children:
 * the futexes are shared futexes, keyed on that object, not private ones). */
struct slot {                 /* one per child, a cache line each */
    _Atomic unsigned word;    /* futex mode: the round number, or STOP */
    unsigned pad;
    double cpu[4];            /* the child's user, sys at the window's start, then at its end */
    char fill[64 - 8 - 4 * sizeof(double)];
};
struct shared {
    _Atomic unsigned gen;     /* bcast and shm modes: the round number, or STOP */
    char fill1[60];
    _Atomic unsigned phase;   /* 0 warm-up, 1 timed, 2 done: children snapshot their CPU on change */
    char fill2[60];
    _Atomic unsigned doorbell; /* shm+wake: bumped by every reply; the parent's futex */
    char fill3[60];
    struct slot slot[];
};

/* shm modes: one request and one reply slot per child, each a cache line of its
 * own (the parent writes one, the child the other). The writer stores the
 * payload, then the sequence word (the round) with release order; the reader
 * loads the word with acquire order, then copies the payload. */
struct message {
    _Alignas(64) _Atomic unsigned seq;
    char payload[MSG_SIZE];
};

_Static_assert(sizeof(struct slot) == 64 && sizeof(struct message) == 64 && sizeof(struct shared) % 64 == 0,
               "every slot a cache line of its own");

static struct shared *shm;
static struct message *requests, *replies; /* n each, in the shared mapping after the slots */
static pid_t group = 0;       /* the children's process group (the first child's pid) */
static int n;
static enum mode mode;
static long replies_taken;    /* replies the parent accepted in the timed rounds */

/* ---- failure: kill and reap every child, then exit ---- */

static void kill_children(void)
{
    if (group > 0)
        kill(-group, SIGKILL);
    while (waitpid(-1, NULL, 0) > 0 || errno == EINTR)
        ;
}

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "wake_bench %s n=%d: ", MODE_NAMES[mode], n);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    kill_children();
    exit(1);
}

static void on_signal(int sig)  /* async-signal-safe: kill, waitpid, _exit only */
{
    if (group > 0)
        kill(-group, SIGKILL);
    while (waitpid(-1, NULL, 0) > 0)
        ;
    _exit(128 + sig);
}

/* ---- small helpers ---- */

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double thread_cpu(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void cpu_times(int who, double *user, double *sys)
{
    struct rusage r;
    getrusage(who, &r);
    *user = r.ru_utime.tv_sec + r.ru_utime.tv_usec * 1e-6;
    *sys = r.ru_stime.tv_sec + r.ru_stime.tv_usec * 1e-6;
}

/* Shared (not FUTEX_PRIVATE_FLAG) futexes: parent and children are separate mms. */
static long futex_wait(_Atomic unsigned *word, unsigned expected)
{
    return syscall(SYS_futex, word, FUTEX_WAIT, expected, NULL, NULL, 0);
}

static long futex_wake(_Atomic unsigned *word, int count)
{
    return syscall(SYS_futex, word, FUTEX_WAKE, count, NULL, NULL, 0);
}

static long futex_wait_for(_Atomic unsigned *word, unsigned expected, double seconds)
{
    struct timespec ts = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
    return syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

static void sleep_for(double seconds)
{
    struct timespec ts = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
    nanosleep(&ts, NULL);
}

static int shm_mode(void)
{
    return mode == SHM || mode == SHM_WAKE;
}

/* ---- io_uring, raw system calls (no liburing) ---- */

static struct {
    int fd;
    unsigned entries, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
} ring = {.fd = -1};

/* 0, or -1 with errno when the kernel (or a seccomp filter) refuses io_uring. */
static int ring_init(unsigned entries)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    ring.fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (ring.fd < 0)
        return -1;
    size_t sq_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) /* one mapping holds both rings */
        sq_size = cq_size = sq_size > cq_size ? sq_size : cq_size;
    char *sq = mmap(NULL, sq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring.fd, IORING_OFF_SQ_RING);
    char *cq = (p.features & IORING_FEAT_SINGLE_MMAP) ? sq
        : mmap(NULL, cq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring.fd, IORING_OFF_CQ_RING);
    ring.sqes = mmap(NULL, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_POPULATE, ring.fd, IORING_OFF_SQES);
    if (sq == MAP_FAILED || cq == MAP_FAILED || ring.sqes == MAP_FAILED)
        return -1;
    ring.entries = p.sq_entries;
    ring.sq_tail = (unsigned *)(sq + p.sq_off.tail);
    ring.sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    ring.sq_array = (unsigned *)(sq + p.sq_off.array);
    ring.cq_head = (unsigned *)(cq + p.cq_off.head);
    ring.cq_tail = (unsigned *)(cq + p.cq_off.tail);
    ring.cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    ring.cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
}

/* Write MSG to every fd, ring.entries writes per io_uring_enter (one call when
 * N fits), and wait for every completion: a write that did not complete whole
 * is an error. */
static void ring_write_all(const int *fds, int count)
{
    for (int first = 0; first < count; first += (int)ring.entries) {
        int batch = count - first < (int)ring.entries ? count - first : (int)ring.entries;
        unsigned tail = *ring.sq_tail;
        for (int i = 0; i < batch; i++, tail++) {
            unsigned index = tail & *ring.sq_mask;
            struct io_uring_sqe *sqe = &ring.sqes[index];
            memset(sqe, 0, sizeof *sqe);
            sqe->opcode = IORING_OP_WRITE;
            sqe->fd = fds[first + i];
            sqe->addr = (unsigned long)MSG;
            sqe->len = MSG_SIZE;
            sqe->off = (__u64)-1; /* the file's position: a pipe has none */
            ring.sq_array[index] = index;
        }
        __atomic_store_n(ring.sq_tail, tail, __ATOMIC_RELEASE);
        long submitted = syscall(__NR_io_uring_enter, ring.fd, batch, batch, IORING_ENTER_GETEVENTS, NULL, 0);
        if (submitted != batch)
            die("io_uring_enter submitted %ld of %d writes (%s)", submitted, batch, strerror(errno));
        unsigned head = *ring.cq_head, done = 0;
        while (done < (unsigned)batch) {
            unsigned end = __atomic_load_n(ring.cq_tail, __ATOMIC_ACQUIRE);
            for (; head != end; head++, done++) {
                int res = ring.cqes[head & *ring.cq_mask].res;
                if (res != MSG_SIZE)
                    die("an io_uring pipe write returned %d (%s)", res, res < 0 ? strerror(-res) : "short");
            }
            __atomic_store_n(ring.cq_head, head, __ATOMIC_RELEASE);
            if (done < (unsigned)batch &&
                syscall(__NR_io_uring_enter, ring.fd, 0, batch - done, IORING_ENTER_GETEVENTS, NULL, 0) < 0 &&
                errno != EINTR)
                die("io_uring_enter waiting for completions: %s", strerror(errno));
        }
    }
}

/* ---- the child ---- */

static void snapshot(struct slot *mine, int at)
{
    cpu_times(RUSAGE_THREAD, &mine->cpu[at], &mine->cpu[at + 1]);
}

/* WAKE_BENCH_FAULT, for the tests: which child misbehaves, and how. */
static int fault_child = -1;
static enum { FAULT_SEQ, FAULT_PAYLOAD } fault_kind;

/* shm modes: take this round's request from the child's request slot and
 * write the reply into its reply slot, the sequence word last (release). */
static void shm_answer(int index, unsigned round)
{
    struct message *request = &requests[index], *reply = &replies[index];
    char got[MSG_SIZE];
    if (atomic_load_explicit(&request->seq, memory_order_acquire) != round)
        _exit(1); /* the parent publishes the request before the round: cannot happen */
    memcpy(got, request->payload, MSG_SIZE);
    if (memcmp(got, MSG, MSG_SIZE) != 0)
        _exit(1);
    memcpy(reply->payload, MSG, MSG_SIZE);
    unsigned seq = round;
    if (index == fault_child && round > 20) { /* after the warm-up's first rounds */
        if (fault_kind == FAULT_SEQ)
            seq = round + 1000;
        else
            reply->payload[3] ^= 0x5a;
    }
    atomic_store_explicit(&reply->seq, seq, memory_order_release);
    if (mode == SHM_WAKE) {
        atomic_fetch_add(&shm->doorbell, 1);
        futex_wake(&shm->doorbell, 1);
    }
}

/* One 16-byte reply per request; exits when its mode says stop. `request` is
 * its request pipe's read end (-1 in the futex-only modes); `reply` its reply
 * pipe's write end (-1 in the shm modes). */
static void child(int index, int request, int reply, int batch)
{
    struct slot *mine = &shm->slot[index];
    unsigned seen = 0, phase = 0;
    char buf[64];
    if (batch) {
        struct sched_param param = {0};
        if (sched_setscheduler(0, SCHED_BATCH, &param) < 0) {
            fprintf(stderr, "wake_bench child %d: sched_setscheduler(SCHED_BATCH): %s\n", index, strerror(errno));
            _exit(1);
        }
    }
    for (;;) {
        /* Wait for this round's wake-up. */
        if (mode == PIPE || mode == URING) {
            ssize_t got = read(request, buf, sizeof buf);
            if (got == 0)
                break;                           /* the parent closed the pipe: stop */
            if (got < 0 && errno == EINTR)
                continue;
            if (got != MSG_SIZE)
                _exit(1);
        } else if (mode == FUTEX || mode == BCAST || shm_mode()) {
            _Atomic unsigned *word = mode == FUTEX ? &mine->word : &shm->gen;
            unsigned value;
            while ((value = atomic_load(word)) == seen)
                futex_wait(word, seen);          /* returns at once if the word moved on */
            seen = value;
            if (seen == STOP)
                break;
        } else { /* PIPE_BCAST: the request is in the pipe; the word only wakes */
            unsigned value = atomic_load(&shm->gen);
            if (value == STOP)
                break;
            ssize_t got = read(request, buf, sizeof buf);
            if (got == 0)
                break;
            if (got < 0 && (errno == EAGAIN || errno == EINTR)) {
                /* Nothing yet. The parent writes the pipe before it moves gen on, so
                 * sleeping while gen == value cannot miss a request: a request written
                 * after our read comes with a gen != value (no sleep) or a wake. */
                futex_wait(&shm->gen, value);
                continue;
            }
            if (got != MSG_SIZE)
                _exit(1);
        }
        if (shm_mode())
            shm_answer(index, seen);
        else if (write(reply, MSG, MSG_SIZE) != MSG_SIZE)
            _exit(1);
        unsigned p = atomic_load(&shm->phase);
        if (p != phase) { /* the timed window opened (1) or closed (2) */
            phase = p;
            if (p == 1)
                snapshot(mine, 0);
        }
    }
    if (phase == 1) /* the window closed after our last reply */
        snapshot(mine, 2);
    _exit(0);
}

/* ---- the parent ---- */

static int *request_w, *reply_r;
static pid_t *pids;

static void fork_children(int batch)
{
    for (int i = 0; i < n; i++) {
        int request[2] = {-1, -1}, reply[2] = {-1, -1};
        int wakes_by_futex = mode == FUTEX || mode == BCAST || shm_mode();
        if ((!wakes_by_futex && pipe2(request, O_CLOEXEC) < 0) || (!shm_mode() && pipe2(reply, O_CLOEXEC) < 0))
            die("pipe2 for child %d: %s (raise the fd limit: ulimit -n)", i, strerror(errno));
        pid_t parent = getpid(), pid = fork();
        if (pid < 0)
            die("fork of child %d: %s", i, strerror(errno));
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != parent) /* the parent died before the line above */
                _exit(1);
            signal(SIGINT, SIG_DFL);
            signal(SIGTERM, SIG_DFL);
            signal(SIGHUP, SIG_DFL);
            signal(SIGPIPE, SIG_DFL);
            setpgid(0, group ? group : 0);
            for (int j = 0; j < i; j++) { /* the earlier children's pipe ends */
                if (request_w[j] >= 0)
                    close(request_w[j]);
                if (reply_r[j] >= 0)
                    close(reply_r[j]);
            }
            if (ring.fd >= 0)
                close(ring.fd);
            if (request[1] >= 0)
                close(request[1]);
            if (reply[0] >= 0)
                close(reply[0]);
            if (mode == PIPE_BCAST)
                fcntl(request[0], F_SETFL, O_NONBLOCK);
            child(i, request[0], reply[1], batch);
        }
        /* Both sides call setpgid, so the group exists whichever runs first. */
        if (setpgid(pid, group ? group : pid) < 0 && errno != EACCES)
            die("setpgid of child %d: %s", i, strerror(errno));
        if (!group)
            group = pid;
        if (request[0] >= 0)
            close(request[0]);
        if (reply[1] >= 0) {
            close(reply[1]);
            fcntl(reply[0], F_SETFL, O_NONBLOCK);
        }
        request_w[i] = request[1];
        reply_r[i] = reply[0];
        pids[i] = pid;
    }
}

static void write_requests(void)
{
    for (int i = 0; i < n; i++)
        if (write(request_w[i], MSG, MSG_SIZE) != MSG_SIZE) {
            if (errno == EPIPE)
                die("child %d closed its request pipe (it exited or was killed)", i);
            die("write to child %d's request pipe: %s", i, strerror(errno));
        }
}

static void wake_all(unsigned round)
{
    switch (mode) {
    case PIPE:
        write_requests();
        break;
    case URING:
        ring_write_all(request_w, n);
        break;
    case FUTEX:
        for (int i = 0; i < n; i++) {
            atomic_store(&shm->slot[i].word, round);
            futex_wake(&shm->slot[i].word, 1);
        }
        break;
    case PIPE_BCAST:
    case BCAST:
    case SHM:
    case SHM_WAKE:
        if (mode == PIPE_BCAST) /* the requests first: the wake must find them there */
            write_requests();
        if (shm_mode())
            for (int i = 0; i < n; i++) {
                memcpy(requests[i].payload, MSG, MSG_SIZE);
                atomic_store_explicit(&requests[i].seq, round, memory_order_release);
            }
        atomic_store(&shm->gen, round);
        futex_wake(&shm->gen, INT_MAX);
        break;
    }
}

static int nap(double since, double deadline)
{
    double t = now(), length = (t - since) / NAP_DIVISOR;
    if (length > NAP_MAX)
        length = NAP_MAX;
    if (!(length >= NAP_MIN) || !(t + length < deadline))
        return 0;
    struct timespec ts = {0, (long)(length * 1e9)};
    return nanosleep(&ts, NULL);
}

/* Wait in epoll until every child has answered `round` once; returns the
 * number of epoll waits. A reply that is not 16 bytes, a second reply, end of
 * file or a round longer than ROUND_DEADLINE is an error. */
static long gather(int epfd, struct epoll_event *events, unsigned char *answered, unsigned round)
{
    int waiting = n, waits = 0;
    double start = now(), deadline = start + ROUND_DEADLINE;
    char buf[4 * MSG_SIZE];
    memset(answered, 0, (size_t)n);
    while (waiting > 0) {
        if (waits > 0 && waiting > NAP_MIN_WAITING)
            nap(start, deadline);
        double left = deadline - now();
        int ready = epoll_wait(epfd, events, n, left > 0 ? (int)(left * 1000) + 1 : 0);
        waits++;
        if (ready < 0 && errno != EINTR)
            die("epoll_wait: %s", strerror(errno));
        if (ready == 0 && now() >= deadline) {
            int first = 0;
            while (answered[first])
                first++;
            die("round %u: %d of %d children had not answered after %.0f s (child %d first); "
                "is the machine overloaded? rerun with fewer children", round, waiting, n, ROUND_DEADLINE, first);
        }
        for (int e = 0; e < ready; e++) {
            int i = (int)events[e].data.u32;
            ssize_t got = read(reply_r[i], buf, sizeof buf);
            if (got < 0 && (errno == EAGAIN || errno == EINTR))
                continue;
            if (got == 0)
                die("child %d closed its reply pipe in round %u: it exited (see its message above)", i, round);
            if (got != MSG_SIZE || answered[i])
                die("child %d answered round %u with %zd bytes%s, expected one reply of %d",
                    i, round, got, answered[i] ? " more" : "", MSG_SIZE);
            answered[i] = 1;
            waiting--;
            replies_taken++;
        }
    }
    return waits;
}

/* shm modes: copy out every reply of `round` that has appeared since the last
 * scan (from child *first on: the ones before have all answered); returns
 * how many. The slot is the child's to write, so its sequence word is checked,
 * and the payload is checked in the parent's own copy, which a child cannot
 * change after the check. */
static int scan(unsigned char *answered, char (*out)[MSG_SIZE], unsigned round, int *first)
{
    int got = 0;
    for (int i = *first; i < n; i++) {
        if (answered[i])
            continue;
        unsigned seq = atomic_load_explicit(&replies[i].seq, memory_order_acquire);
        if (seq == round - 1)
            continue; /* not yet */
        if (seq != round)
            die("child %d's reply slot holds sequence %u in round %u (expected %u or %u): "
                "a child wrote its slot out of turn", i, seq, round, round - 1, round);
        memcpy(out[i], replies[i].payload, MSG_SIZE);
        if (memcmp(out[i], MSG, MSG_SIZE) != 0)
            die("child %d's reply in round %u is not the %d bytes every reply must be", i, round, MSG_SIZE);
        answered[i] = 1;
        got++;
        replies_taken++;
    }
    while (*first < n && answered[*first])
        (*first)++;
    return got;
}

/* shm modes, once a round is slow: die naming a child that has exited (its
 * slot will never move on); the deadline catches one that is alive but stuck. */
static void check_alive(unsigned round)
{
    int status;
    pid_t pid = waitpid(-group, &status, WNOHANG);
    if (pid <= 0)
        return;
    int i = 0;
    while (i < n && pids[i] != pid)
        i++;
    die("child %d (pid %d) ended with %s %d in round %u", i, pid,
        WIFEXITED(status) ? "exit code" : "signal", WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
        round);
}

/* The shm modes' fan-in: no system call per child. Scan the reply slots; while
 * some are still out, sleep: shm naps (nap()'s length, but at least NAP_MIN,
 * since there is no epoll to sleep in), shm+wake waits on the doorbell until a
 * reply rings it, then lets at least NAP_MIN pass since the last scan, so
 * wake-ups that come faster (or spurious ones) cannot make it spin. The
 * doorbell is read before the scan: a reply the scan misses has moved it on,
 * and FUTEX_WAIT then returns at once. Returns the parent's sleeps (nanosleep
 * and FUTEX_WAIT calls). A round longer than ROUND_DEADLINE is an error. */
static long gather_shm(unsigned char *answered, char (*out)[MSG_SIZE], unsigned round)
{
    int waiting = n, first = 0;
    long sleeps = 0;
    double start = now(), deadline = start + ROUND_DEADLINE;
    memset(answered, 0, (size_t)n);
    for (;;) {
        unsigned bell = atomic_load_explicit(&shm->doorbell, memory_order_acquire);
        waiting -= scan(answered, out, round, &first);
        if (waiting == 0)
            return sleeps;
        double t = now();
        if (t >= deadline)
            die("round %u: %d of %d children had not answered after %.0f s (child %d first); "
                "is the machine overloaded? rerun with fewer children", round, waiting, n, ROUND_DEADLINE, first);
        if (t - start >= LIVENESS_AFTER)
            check_alive(round);
        if (mode == SHM) {
            double length = (t - start) / NAP_DIVISOR;
            length = length < NAP_MIN ? NAP_MIN : length > NAP_MAX ? NAP_MAX : length;
            sleep_for(length < deadline - t ? length : deadline - t);
            sleeps++;
            continue;
        }
        /* Woken, timed out or EAGAIN: scan. At most LIVENESS_AFTER, so a dead child,
         * which rings no bell, is looked for as in shm. */
        futex_wait_for(&shm->doorbell, bell, deadline - t < LIVENESS_AFTER ? deadline - t : LIVENESS_AFTER);
        sleeps++;
        double gap = now() - t;
        if (gap < NAP_MIN) {
            sleep_for(NAP_MIN - gap);
            sleeps++;
        }
    }
}

/* Tell the children to stop, the mode's own way, and reap them by a deadline. */
static void stop_children(void)
{
    atomic_store(&shm->gen, STOP);
    futex_wake(&shm->gen, INT_MAX);
    for (int i = 0; i < n; i++) {
        atomic_store(&shm->slot[i].word, STOP);
        futex_wake(&shm->slot[i].word, 1);
        if (request_w[i] >= 0)
            close(request_w[i]);
        request_w[i] = -1;
    }
    double deadline = now() + EXIT_DEADLINE;
    int left = n, status;
    while (left > 0) {
        pid_t pid = waitpid(-group, &status, WNOHANG);
        if (pid < 0)
            die("waitpid: %s", strerror(errno));
        if (pid == 0) {
            if (now() > deadline)
                die("%d of %d children had not exited %.0f s after the stop", left, n, EXIT_DEADLINE);
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
            continue;
        }
        left--;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
            die("a child (pid %d) ended with %s %d at the stop", pid,
                WIFEXITED(status) ? "exit code" : "signal", WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    }
    group = 0;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: wake_bench pipe|futex|bcast|pipe+bcast|uring|shm|shm+wake other|batch N ROUNDS\n");
        return 2;
    }
    int found = 0;
    for (int m = 0; m < (int)(sizeof MODE_NAMES / sizeof *MODE_NAMES); m++)
        if (strcmp(argv[1], MODE_NAMES[m]) == 0)
            mode = (enum mode)m, found = 1;
    int batch = strcmp(argv[2], "batch") == 0;
    char *end1, *end2;
    long n_arg = strtol(argv[3], &end1, 10), rounds = strtol(argv[4], &end2, 10);
    if (!found || (!batch && strcmp(argv[2], "other") != 0) || *end1 || *end2 ||
        n_arg < 1 || n_arg > MAX_N || rounds < 1 || rounds > 100000000) {
        fprintf(stderr, "wake_bench: bad arguments (MODE one of pipe futex bcast pipe+bcast uring shm shm+wake; "
                        "SCHED other or batch; 1 <= N <= %d; ROUNDS >= 1)\n", MAX_N);
        return 2;
    }
    n = (int)n_arg;
    const char *deadline_arg = getenv("WAKE_BENCH_ROUND_DEADLINE");
    if (deadline_arg && *deadline_arg) {
        char *end;
        double value = strtod(deadline_arg, &end);
        if (end == deadline_arg || *end || !(value >= 0.1 && value <= 3600)) {
            fprintf(stderr, "wake_bench: bad WAKE_BENCH_ROUND_DEADLINE %.40s (seconds, 0.1-3600)\n", deadline_arg);
            return 2;
        }
        ROUND_DEADLINE = value;
    }
    const char *fault = getenv("WAKE_BENCH_FAULT");
    if (fault && *fault) {
        char *kind;
        long child_arg = strtol(fault, &kind, 10);
        if (kind == fault || *kind != ':' || child_arg < 0 || child_arg >= n ||
            (strcmp(kind + 1, "seq") != 0 && strcmp(kind + 1, "payload") != 0)) {
            fprintf(stderr, "wake_bench: bad WAKE_BENCH_FAULT %.40s (CHILD:seq or CHILD:payload, 0 <= CHILD < N)\n",
                    fault);
            return 2;
        }
        fault_child = (int)child_arg;
        fault_kind = strcmp(kind + 1, "seq") == 0 ? FAULT_SEQ : FAULT_PAYLOAD;
    }

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    /* A child that dies leaves its request pipe without a reader: the next
     * write there is EPIPE, reported as its death, not a SIGPIPE that kills
     * the parent before it can name the child (children get SIG_DFL back). */
    signal(SIGPIPE, SIG_IGN);

    if (mode == URING && ring_init(n < 4096 ? (unsigned)n : 4096u) < 0) {
        fprintf(stderr, "wake_bench uring: io_uring_setup refused (%s): io_uring is disabled or "
                        "filtered here; the other modes still run\n", strerror(errno));
        return 3;
    }
    size_t shm_size = sizeof(struct shared) + (size_t)n * (sizeof(struct slot) + 2 * sizeof(struct message));
    shm = mmap(NULL, shm_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    request_w = calloc((size_t)n, sizeof *request_w);
    reply_r = calloc((size_t)n, sizeof *reply_r);
    pids = calloc((size_t)n, sizeof *pids);
    unsigned char *answered = malloc((size_t)n);
    char (*out)[MSG_SIZE] = malloc((size_t)n * MSG_SIZE);
    struct epoll_event *events = calloc((size_t)n, sizeof *events);
    if (shm == MAP_FAILED || !request_w || !reply_r || !pids || !answered || !out || !events)
        die("out of memory");
    requests = (struct message *)&shm->slot[n]; /* both 64-byte aligned: the slots are 64 bytes each */
    replies = requests + n;

    fork_children(batch);
    int epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0)
        die("epoll_create1: %s", strerror(errno));
    for (int i = 0; i < n && !shm_mode(); i++) {
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (unsigned)i};
        if (epoll_ctl(epfd, EPOLL_CTL_ADD, reply_r[i], &ev) < 0)
            die("epoll_ctl: %s", strerror(errno));
    }

    long warmup = rounds / 10 < 10 ? 10 : rounds / 10 > 200 ? 200 : rounds / 10;
    unsigned round = 0;
    long waits = 0;
    double user0 = 0, sys0 = 0, t0 = 0, waking = 0;
    for (long r = 0; r < warmup + rounds; r++) {
        if (r == warmup) {
            atomic_store(&shm->phase, 1);
            cpu_times(RUSAGE_SELF, &user0, &sys0);
            t0 = now();
            waits = 0;
            waking = 0;
            replies_taken = 0;
        }
        double before = thread_cpu();
        wake_all(++round);
        waking += thread_cpu() - before;
        waits += shm_mode() ? gather_shm(answered, out, round) : gather(epfd, events, answered, round);
    }
    double user1, sys1, t1 = now();
    cpu_times(RUSAGE_SELF, &user1, &sys1);
    atomic_store(&shm->phase, 2);
    stop_children();

    double child_user = 0, child_sys = 0, per = 1e6 / ((double)rounds * n);
    for (int i = 0; i < n; i++) {
        child_user += shm->slot[i].cpu[2] - shm->slot[i].cpu[0];
        child_sys += shm->slot[i].cpu[3] - shm->slot[i].cpu[1];
    }
    printf("{\"mode\": \"%s\", \"sched\": \"%s\", \"n\": %d, \"rounds\": %ld, \"seconds\": %.6f, "
           "\"parent_user_us\": %.4f, \"parent_sys_us\": %.4f, \"child_user_us\": %.4f, \"child_sys_us\": %.4f, "
           "\"parent_wake_us\": %.4f, \"child_rounds_per_s\": %.1f, \"waits_per_round\": %.4f, \"replies\": %ld}\n",
           MODE_NAMES[mode], batch ? "batch" : "other", n, rounds, t1 - t0,
           (user1 - user0) * per, (sys1 - sys0) * per, child_user * per, child_sys * per, waking * per,
           (double)rounds * n / (t1 - t0), (double)waits / rounds, replies_taken);
    return 0;
}
