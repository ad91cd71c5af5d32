/* boltzlabs.worker._fastpath: the worker's synchronous step in C (issue #16).
 *
 * One entry point reads env bytes: step() (the second half of this file), the
 * hot path of an ungated pool's step (boltzlabs/worker/requests._step_native).
 * vouch() runs step()'s check of one reply on given bytes, for tests and
 * fuzzing. A lane's channel is two fds: the one written (wfds) and the one
 * read (rfds): two pipes, or one socket given twice.
 *
 * One call writes each lane's request (wire.py's frames: a 4-byte
 * little-endian body length, then the msgpack body), waits on the worker's
 * own epoll set until every lane has answered or the deadline passes, and
 * reads each lane's reply: in one read, or, when the first read's prefix
 * announces a longer frame (an image observation; within max_frame and the
 * byte budget), in as many as it takes, each read taking exactly what is
 * still missing into the space reserved for that frame. A reply walk()
 * vouches for stays undecoded; every other lane goes back to Python
 * (Batch.rest), so everything unusual takes the pure-Python path unchanged:
 *
 *   - a read not vouched for (several frames, an oversized or garbled
 *     prefix, a value walk() is unsure of, a long frame cut short by the
 *     deadline or end of file) -> (UNUSUAL, the bytes read), fed to the
 *     lane's FrameReader;
 *   - end of file or a read error -> (EOF, b"");
 *   - a short write -> (SHORT_WRITE_KIND, the frame's bytes not written), and
 *     the call returns before waiting: the event loop writes the rest;
 *   - a lane not read -> (PENDING, None).
 *
 * It returns early, leaving the lanes it has not read pending, when the
 * epoll set reports any fd that is not one of its lanes (a log pipe, a pidfd,
 * the client's socket, a straggler's channel: the worker's event loop handles
 * them), when the deadline passes, and when the bytes it has read pass
 * `budget` (the pool's byte budget, limits.max_pool_bytes, less what the pool
 * holds). A long frame's whole size counts against the budget when its
 * space is reserved, so the bytes held are bounded by budget + one read.
 *
 * Everything read here comes from an untrusted env: the only parsing is
 * vouch() and walk() below, bounded as their comment says.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <poll.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "arrays.h" /* array_header_ok: wire.check_array_header in C */

/* Batch.rest's kinds: how a lane Python must finish was left. */
#define KIND_PENDING 0 /* nothing read yet */
#define KIND_EOF 1
#define KIND_UNUSUAL 2
#define KIND_SHORT_WRITE 3

/* Why step() returned (Batch.why). */
#define DONE 0
#define TIMEOUT 1
#define FOREIGN 2
#define SHORT_WRITE 3
#define BUDGET 4

#define READ_SIZE 65536 /* the pure path's _READ_SIZE */
#define MAX_EVENTS 1024

static double monotonic_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of Python's time.monotonic() */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Write data to a non-blocking fd: the bytes written, fewer than size when
 * it would block. Any other error counts as all written, as the pure path
 * ignores it: the channel is gone, and EOF or the pidfd says why. */
static size_t write_all(int fd, const unsigned char *data, size_t size)
{
    size_t sent = 0;
    while (sent < size) {
        ssize_t w = write(fd, data + sent, size - sent);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        if (w < 0)
            return size;
        sent += (size_t)w;
    }
    return sent;
}

/* epoll_wait on epfd until something is ready or `deadline` (time.monotonic())
 * passes, the GIL released: the number of events, 0 at the deadline, or -1
 * with an exception set (an epoll error, or a signal handler that raised:
 * e.g. SIGTERM's). Once the deadline has passed, one look more that does not
 * wait (`*looked`, once per step): the worker itself may not have run until
 * past the deadline (a loaded node), and replies already in their pipes are
 * read, not taken for stragglers; an env trickling bytes cannot extend the
 * step past that one look (requests.py's _wait looks the same way). */
static int wait_ready(int epfd, struct epoll_event *events, int max_events, double deadline, int *looked)
{
    for (;;) {
        double left = deadline - monotonic_now();
        int timeout;
        if (!(left > 0)) { /* NaN included: no (int) cast of it below */
            if (*looked)
                return 0;
            *looked = 1;
            timeout = 0;
        } else {
            /* Round up: waking a little after the deadline, never before it. */
            double ms = left * 1000.0 + 1.0;
            timeout = ms > 86400000.0 ? 86400000 : (int)ms;
        }
        int ready;
        Py_BEGIN_ALLOW_THREADS
        ready = epoll_wait(epfd, events, max_events, timeout);
        Py_END_ALLOW_THREADS
        if (ready > 0)
            return ready;
        if (ready < 0 && errno != EINTR) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (ready < 0 && PyErr_CheckSignals() < 0)
            return -1;
    }
}

/* poll one lane's read end until it is readable or `deadline` passes, the GIL released: 1, 0
 * at the deadline, or -1 with an exception set (as wait_ready). The lent step's wait in lane
 * order (step()'s `ordered`): a trainer that waits only for the first lane still out is woken
 * by that lane alone, not by each group that answers while another still runs on the core it
 * shares with the trainer (measured: LunarLander, 2 groups of 16 on 2 cores, 1.03x). */
static int wait_lane(int fd, double deadline)
{
    for (;;) {
        double left = deadline - monotonic_now();
        if (!(left > 0))
            return 0;
        double ms = left * 1000.0 + 1.0;
        int timeout = ms > 86400000.0 ? 86400000 : (int)ms;
        struct pollfd pfd = {fd, POLLIN, 0};
        int ready;
        Py_BEGIN_ALLOW_THREADS
        ready = poll(&pfd, 1, timeout);
        Py_END_ALLOW_THREADS
        if (ready > 0)
            return 1;
        if (ready < 0 && errno != EINTR) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (ready < 0 && PyErr_CheckSignals() < 0)
            return -1;
    }
}

/* Coalescing the fan-in's wake-ups. Every time the worker sleeps in
 * epoll_wait, the next env to answer wakes it (a context switch for the
 * worker, and the wake-up's cost for the env), and it reads the one or two
 * replies in by then: measured 0.40-0.58 worker sleeps per env-step, most of
 * the worker's CPU after the step moved to C. So between two waits, while
 * more than NAP_MIN_WAITING lanes are still out, the worker first naps for an
 * eighth of the time the fan-in has taken so far (at most NAP_MAX), letting
 * replies pile up to be read in one round; an env that writes while the
 * worker naps wakes nobody. The nap never reaches past the deadline, so a
 * step answers a little later than its last reply (by at most an eighth of
 * its duration) and never later than the deadline. Measured, paired:
 * 1.3-1.4x the env-steps/s at n = 64 and 512, worker CPU per env-step 13 ->
 * 7-8 us (docs/performance.md). */
#define NAP_MIN_WAITING 8
#define NAP_DIVISOR 8.0
#define NAP_MAX 0.001  /* seconds */
#define NAP_MIN 0.00001 /* a shorter nap would cost more than it saves */

static int nap(double since, double deadline)
{
    double now = monotonic_now();
    double length = (now - since) / NAP_DIVISOR;
    if (length > NAP_MAX)
        length = NAP_MAX;
    if (!(length >= NAP_MIN) || !(now + length < deadline)) /* NaN: no nap */
        return 0;
    struct timespec ts = {0, (long)(length * 1e9)};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = nanosleep(&ts, NULL);
    Py_END_ALLOW_THREADS
    if (rc < 0 && errno == EINTR && PyErr_CheckSignals() < 0)
        return -1; /* a signal handler raised (SIGTERM's): as wait_ready does */
    return 0;
}

/* ==========================================================================
 * step(): the whole synchronous step of an ungated pool in one call (issue #16).
 *
 *     requests.step --actions, packed once--> step() --one STEP/RESET frame per lane--> channels
 *                   <--Batch: replies vouched for, undecoded-- step() <--a read per lane (a long frame: until whole)-- (epoll)
 *     Batch.compose(overrides) --> the REPLY's result, raw msgpack, spliced from the env's own bytes
 *
 * The frames are built here exactly as wire.encode builds them
 * ([STEP, seq, action, False] or [RESET, seq, None, None], minimal seq).
 * Each lane's one read is checked by walk() below: a reply it vouches for
 * (exactly one frame, the reply due, every length, depth, object count,
 * UTF-8 string and array header within what wire.decode(body, the worker's
 * env limits) and reactor.check_reply accept) is never decoded: its obs and
 * info bytes go into the REPLY as they came. Everything else, and anything
 * walk() is unsure of, goes back to Python as the bytes read, so Python
 * accepts it or names what is wrong exactly as before. walk() may refuse
 * what Python accepts; it must never accept what Python refuses.
 *
 * walk() reads untrusted bytes: no recursion (an explicit stack, its depth
 * checked before each push), lengths as uint64 compared with what is left
 * before any index moves, every container's items paid for in max_objects
 * before they are walked.
 */

/* Message codes (wire.py). */
#define W_STEPPED 1
#define W_RESET_DONE 2
#define W_STEP 10
#define W_RESET 11
#define ARRAY_EXT 1
#define TUPLE_EXT 2
#define SCALAR_EXT 3
#define SLOT_EXT 4 /* wire.SLOT_EXT: fixext 8, the request's seq little-endian; only ever the obs */
#define MAX_TUPLE_NESTING 32 /* wire.MAX_TUPLE_NESTING */
#define STACK_MAX 1024       /* levels walk() can hold: over wire.MAX_DEPTH (512) and msgpack's packer (511) */

/* The caps of wire.Limits (the worker's env limits), in walk()'s terms. */
typedef struct {
    uint64_t max_frame, max_str, max_bin, max_array, max_map, max_ext, max_depth, max_objects;
    uint64_t slots; /* nonzero: a reply's obs may be a SLOT_EXT marker (the pool's envs have observation slots) */
} Caps;

typedef struct {
    uint64_t left;     /* items still to walk (a map counts its keys and values) */
    size_t end;        /* a tuple: where its payload ends (its array must fill it); 0 otherwise */
    size_t outer;      /* a tuple: the limit around it, restored when it closes */
    unsigned char map;
} Level;

/* One walker: walk() runs with the GIL held and calls no Python, so one serves every call. */
static Level stack[STACK_MAX];

/* A frame's body length: its 4-byte little-endian prefix (wire.HEADER). */
static inline uint64_t body_length(const unsigned char *p)
{
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) | ((uint64_t)p[3] << 24);
}

static inline uint64_t big_endian(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* A big-endian length of `width` bytes at buf[*pos], if it lies before `limit`. */
static inline int take_len(const unsigned char *buf, size_t *pos, size_t limit, int width, uint64_t *out)
{
    if (limit - *pos < (size_t)width)
        return 0;
    *out = big_endian(buf + *pos, width);
    *pos += (size_t)width;
    return 1;
}

/* A msgpack array header at buf[*pos] (fixarray, array 16 or array 32), before `end`: 1 and
 * its item count in *n, *pos moved past it; or 0. */
static int array_head(const unsigned char *buf, size_t *pos, size_t end, uint64_t *n)
{
    if (*pos >= end)
        return 0;
    unsigned b = buf[(*pos)++];
    if (b >= 0x90 && b <= 0x9f) {
        *n = b & 0x0f;
        return 1;
    }
    return (b == 0xdc || b == 0xdd) && take_len(buf, pos, end, 2 << (b - 0xdc), n);
}

/* Python's strict UTF-8 decoder: no overlong forms, no surrogates, nothing past U+10FFFF. */
static int utf8_ok(const unsigned char *s, uint64_t n)
{
    uint64_t i = 0;
    while (i < n) {
        unsigned c = s[i], lo = 0x80, hi = 0xbf; /* the range of the second byte */
        uint64_t need;
        if (c < 0x80) {
            /* The hot case, ASCII text (a program, a test log): the rest of the run eight bytes
             * at a time, none with its high bit set. A byte at a time, a 64 KiB log cost the
             * worker more than the rest of its reply (benchmarks/bench_text.py). */
            i++;
            while (n - i >= 8 && s[i] < 0x80) {
                uint64_t word;
                memcpy(&word, s + i, 8);
                if (word & 0x8080808080808080ULL)
                    break;
                i += 8;
            }
            continue;
        }
        if (c >= 0xc2 && c <= 0xdf)
            need = 2;
        else if (c >= 0xe0 && c <= 0xef) {
            need = 3;
            lo = c == 0xe0 ? 0xa0 : lo; /* overlong */
            hi = c == 0xed ? 0x9f : hi; /* surrogates */
        } else if (c >= 0xf0 && c <= 0xf4) {
            need = 4;
            lo = c == 0xf0 ? 0x90 : lo; /* overlong */
            hi = c == 0xf4 ? 0x8f : hi; /* past U+10FFFF */
        } else
            return 0;
        if (n - i < need || s[i + 1] < lo || s[i + 1] > hi)
            return 0;
        for (uint64_t k = 2; k < need; k++)
            if ((s[i + k] & 0xc0) != 0x80)
                return 0;
        i += need;
    }
    return 1;
}

/* Walk exactly one msgpack value at buf[*pos], ending by `end`, whose
 * containers sit at levels depth+1 and deeper (the message is level 1, as
 * wire._too_deep counts; a tuple is a level). caps NULL: a structural walk
 * of bytes the worker's own packer made (any ext, any key, no caps but the
 * stack). Returns 1 and moves *pos past the value, or 0: not vouched for.
 * *objects counts as wire.Limits' hooks do: 1 + len per array and tuple,
 * 1 + 2 len per map. */
static int walk(const unsigned char *buf, size_t *pos_io, size_t end, uint64_t depth, const Caps *caps,
                uint64_t *objects)
{
    size_t pos = *pos_io, limit = end;
    uint64_t max_depth = caps ? caps->max_depth : STACK_MAX;
    int top = 0, tuples = 0, started = 0;
    for (;;) {
        while (top > 0 && stack[top - 1].left == 0) {
            Level *done = &stack[--top];
            if (done->end) { /* a tuple: msgpack.unpackb(payload) must use it all */
                if (pos != done->end)
                    return 0;
                limit = done->outer;
                tuples--;
            }
        }
        if (top == 0 && started)
            break;
        started = 1;
        int key = 0;
        if (top > 0) {
            Level *l = &stack[top - 1];
            key = l->map && (l->left & 1) == 0;
            l->left--;
        }
        if (pos >= limit)
            return 0;
        unsigned b = buf[pos++];
        uint64_t len, n;
        int type, width;
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
            continue; /* int, nil, bool */
        if (b >= 0xa0 && b <= 0xbf) {
            len = b & 0x1f;
            goto str;
        }
        if (b >= 0x90 && b <= 0x9f) {
            n = b & 0x0f;
            goto array;
        }
        if (b >= 0x80 && b <= 0x8f) {
            n = b & 0x0f;
            goto map;
        }
        switch (b) {
        case 0xcc: case 0xd0: width = 1; goto skip;
        case 0xcd: case 0xd1: width = 2; goto skip;
        case 0xca: case 0xce: case 0xd2: width = 4; goto skip;
        case 0xcb: case 0xcf: case 0xd3: width = 8; goto skip;
        /* A length of 1, 2 or 4 bytes (8, 16, 32 bits) after the marker. */
        case 0xd9: case 0xda: case 0xdb:
            if (!take_len(buf, &pos, limit, 1 << (b - 0xd9), &len))
                return 0;
            goto str;
        case 0xc4: case 0xc5: case 0xc6:
            if (!take_len(buf, &pos, limit, 1 << (b - 0xc4), &len) || (caps && len > caps->max_bin) ||
                len > limit - pos)
                return 0;
            pos += len;
            continue;
        case 0xdc: case 0xdd:
            if (!take_len(buf, &pos, limit, 2 << (b - 0xdc), &n))
                return 0;
            goto array;
        case 0xde: case 0xdf:
            if (!take_len(buf, &pos, limit, 2 << (b - 0xde), &n))
                return 0;
            goto map;
        case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8:
            len = (uint64_t)1 << (b - 0xd4);
            goto ext;
        case 0xc7: case 0xc8: case 0xc9:
            if (!take_len(buf, &pos, limit, 1 << (b - 0xc7), &len))
                return 0;
            goto ext;
        default: /* 0xc1, reserved: Python names it */
            return 0;
        }
    skip:
        if (limit - pos < (size_t)width)
            return 0;
        pos += width;
        continue;
    str:
        if (caps && len > caps->max_str)
            return 0;
        if (len > limit - pos || (caps && !utf8_ok(buf + pos, len)))
            return 0;
        pos += len;
        continue;
    array:
        if (caps && (key || n > caps->max_array))
            return 0;
        goto container;
    map:
        if (caps && (key || n > caps->max_map))
            return 0;
        n *= 2; /* n < 2**32 */
    container:
        /* Each item takes at least one byte: a count past what is left is a lie. */
        if (n > limit - pos || depth + (uint64_t)top + 1 > max_depth || top >= STACK_MAX)
            return 0;
        if (caps) {
            *objects += 1 + n;
            if (*objects > caps->max_objects)
                return 0;
        }
        stack[top].left = n;
        stack[top].end = 0;
        stack[top].outer = 0;
        stack[top].map = b >= 0x80 && b <= 0x8f ? 1 : (b == 0xde || b == 0xdf);
        top++;
        continue;
    ext:
        if (limit - pos < 1)
            return 0;
        type = (signed char)buf[pos++];
        if (caps && len > caps->max_ext)
            return 0;
        if (len > limit - pos)
            return 0;
        if (caps == NULL) { /* the worker's own packing: any ext is opaque */
            pos += len;
            continue;
        }
        if (key)
            return 0;
        if (type == ARRAY_EXT || type == SCALAR_EXT) {
            if (!array_header_ok(buf + pos, len, type == SCALAR_EXT))
                return 0;
            pos += len;
            continue;
        }
        if (type != TUPLE_EXT || tuples >= MAX_TUPLE_NESTING)
            return 0;
        {
            /* A tuple: its payload is exactly one array, its items one level down. */
            size_t tend = pos + (size_t)len;
            if (tend - pos < 1)
                return 0;
            unsigned h = buf[pos++];
            if (h >= 0x90 && h <= 0x9f)
                n = h & 0x0f;
            else if ((h != 0xdc && h != 0xdd) || !take_len(buf, &pos, tend, 2 << (h - 0xdc), &n))
                return 0;
            if (n > caps->max_array || n > tend - pos || depth + (uint64_t)top + 1 > max_depth || top >= STACK_MAX)
                return 0;
            *objects += 1 + n;
            if (*objects > caps->max_objects)
                return 0;
            stack[top].left = n;
            stack[top].end = tend;
            stack[top].outer = limit;
            stack[top].map = 0;
            top++;
            tuples++;
            limit = tend;
        }
    }
    *pos_io = pos;
    return 1;
}

/* A non-negative msgpack int at buf[*pos]: 1 and its value, or 0. */
static int read_uint(const unsigned char *buf, size_t *pos, size_t end, uint64_t *value)
{
    if (*pos >= end)
        return 0;
    unsigned b = buf[(*pos)++];
    int width;
    if (b <= 0x7f) {
        *value = b;
        return 1;
    }
    if (b >= 0xcc && b <= 0xcf)
        width = 1 << (b - 0xcc);
    else if (b >= 0xd0 && b <= 0xd3)
        width = 1 << (b - 0xd0);
    else
        return 0;
    if (end - *pos < (size_t)width)
        return 0;
    uint64_t v = big_endian(buf + *pos, width);
    *pos += width;
    if (b >= 0xd0 && (v >> (8 * width - 1)) & 1) /* a negative int */
        return 0;
    *value = v;
    return 1;
}

/* A msgpack number at buf[*pos] (float 32 or 64, or an int of any width), as Python's float()
 * of its decoding gives it: 1 and *value, or 0 (anything else, a bool included). */
static int read_number(const unsigned char *buf, size_t *pos_io, size_t end, double *value)
{
    size_t pos = *pos_io;
    uint64_t v;
    if (pos >= end)
        return 0;
    unsigned b = buf[pos];
    if (b == 0xca) {
        if (end - pos < 5)
            return 0;
        uint32_t bits = (uint32_t)big_endian(buf + pos + 1, 4);
        float f;
        memcpy(&f, &bits, 4);
        *value = (double)f;
        pos += 5;
    } else if (b == 0xcb) {
        if (end - pos < 9)
            return 0;
        uint64_t bits = big_endian(buf + pos + 1, 8);
        memcpy(value, &bits, 8);
        pos += 9;
    } else if (b <= 0x7f || (b >= 0xcc && b <= 0xcf)) {
        if (!read_uint(buf, &pos, end, &v))
            return 0;
        *value = (double)v; /* rounded to nearest, as float(int) */
    } else if (b >= 0xe0) {
        *value = (double)(int8_t)b;
        pos++;
    } else if (b >= 0xd0 && b <= 0xd3) {
        int width = 1 << (b - 0xd0);
        if (end - pos - 1 < (size_t)width)
            return 0;
        v = big_endian(buf + pos + 1, width);
        int64_t s = width == 1 ? (int8_t)v : width == 2 ? (int16_t)v : width == 4 ? (int32_t)v : (int64_t)v;
        *value = (double)s;
        pos += 1 + width;
    } else
        return 0;
    *pos_io = pos;
    return 1;
}

/* What vouch() found in one reply: where obs and info lie, and the scalars. */
typedef struct {
    size_t obs, obs_len, info, info_len; /* offsets into the bytes read */
    size_t start, have, want; /* LANE_PARTIAL: its frame's place in Batch.buf, bytes read, frame size */
    double reward;
    unsigned char terminated, truncated, state;
} Lane;

/* Whether buf[0:got] is exactly one frame holding the reply due
 * ([STEPPED, seq, obs, reward, bool, bool, map] or, for a reset lane,
 * [RESET_DONE, seq, obs, map]) that wire.decode under `caps` and
 * reactor.check_reply accept. 1 (and *lane filled in) or 0. */
static int vouch(const unsigned char *buf, size_t got, const Caps *caps, int reset, uint64_t seq, Lane *lane)
{
    if (got < 5)
        return 0;
    uint64_t body = body_length(buf);
    if (body > caps->max_frame || body != got - 4)
        return 0;
    size_t pos = 4, end = got;
    uint64_t n, value, objects;
    unsigned b;
    if (!array_head(buf, &pos, end, &n))
        return 0;
    if (n != (reset ? 4u : 7u) || n > caps->max_array || caps->max_depth < 1)
        return 0;
    objects = 1 + n;
    if (objects > caps->max_objects)
        return 0;
    if (!read_uint(buf, &pos, end, &value) || value != (reset ? W_RESET_DONE : W_STEPPED))
        return 0;
    if (!read_uint(buf, &pos, end, &value) || value != seq)
        return 0;
    lane->obs = pos;
    if (caps->slots && end - pos >= 10 && buf[pos] == 0xd7 && buf[pos + 1] == SLOT_EXT) {
        /* The obs is in the env's slot: the marker must name this request (lifecycle.Lifecycle._on_message). */
        uint64_t mark = 0;
        for (int i = 7; i >= 0; i--)
            mark = (mark << 8) | buf[pos + 2 + i];
        if (mark != seq)
            return 0;
        pos += 10;
    } else if (!walk(buf, &pos, end, 1, caps, &objects))
        return 0;
    lane->obs_len = pos - lane->obs;
    lane->reward = 0.0;
    lane->terminated = lane->truncated = 0;
    if (!reset) {
        if (!read_number(buf, &pos, end, &lane->reward))
            return 0;
        if (end - pos < 2 || (buf[pos] & 0xfe) != 0xc2 || (buf[pos + 1] & 0xfe) != 0xc2)
            return 0;
        lane->terminated = buf[pos] & 1;
        lane->truncated = buf[pos + 1] & 1;
        pos += 2;
    }
    if (pos >= end)
        return 0;
    b = buf[pos];
    if (!((b >= 0x80 && b <= 0x8f) || b == 0xde || b == 0xdf)) /* check_reply: a dict */
        return 0;
    lane->info = pos;
    if (!walk(buf, &pos, end, 1, caps, &objects))
        return 0;
    lane->info_len = pos - lane->info;
    return pos == end; /* msgpack.unpackb: no extra data */
}

/* --- A group's reply, read whole (runtime/group.py, pool/groups.py) ------------------------
 *
 * A sandbox of k envs answers a step with one reply whose info is {GROUP_KEY: [kinds, rewards,
 * terminated, truncated, infos, errors]}, a list of one item per member each. group_whole()
 * reads the plain reply to a turn of all its members straight into the trainer's arrays: only
 * when it is exactly what pool/groups.py's _stepped_whole accepts (each member answered as
 * sent, rewards numbers, flags bools, no error) and its obs is in the group's slot. Anything
 * else, however valid, is left to Python (the caller decodes the reply as ever): C never
 * accepts what Python would refuse, nor reads it otherwise. */

#define GROUP_KEY "boltzlabs.group"
#define GROUP_KEY_LEN 15

/* An array header at buf[*pos] of exactly `count` items: 1, or 0. */
static int array_of(const unsigned char *buf, size_t *pos, size_t end, uint64_t count)
{
    uint64_t n;
    return array_head(buf, pos, end, &n) && n == count;
}

/* Whether lane's vouched reply in buf is a group's whole answer to `sent` (count members,
 * each STEPPED 0 or RESET 1). If so: each member's reward and flags in rewards, terminated,
 * truncated (a reset member's 0.0, False, False, as the trainer gives it), and *infos_len 0
 * when every member's info is empty ({} or nil), else *infos_at and *infos_len span the infos
 * item for Python to decode and check (info columns, or a list of dicts). */
static int group_whole(const unsigned char *buf, const Lane *lane, const unsigned char *sent, size_t count,
                       double *rewards, unsigned char *terminated, unsigned char *truncated, size_t *infos_at,
                       size_t *infos_len)
{
    if (lane->obs_len != 10 || buf[lane->obs] != 0xd7 || buf[lane->obs + 1] != SLOT_EXT)
        return 0; /* the obs by the wire: Python's */
    size_t pos = lane->info, end = lane->info + lane->info_len;
    if (end - pos < 2 + GROUP_KEY_LEN || buf[pos] != 0x81 || buf[pos + 1] != (0xa0 | GROUP_KEY_LEN) ||
        memcmp(buf + pos + 2, GROUP_KEY, GROUP_KEY_LEN) != 0)
        return 0;
    pos += 2 + GROUP_KEY_LEN;
    if (pos >= end || buf[pos++] != 0x96) /* [kinds, rewards, terminated, truncated, infos, errors] */
        return 0;
    if (!array_of(buf, &pos, end, count))
        return 0;
    for (size_t j = 0; j < count; j++) /* kinds: each as sent (0 or 1, a positive fixint) */
        if (pos >= end || sent[j] > 1 || buf[pos++] != sent[j])
            return 0;
    if (!array_of(buf, &pos, end, count))
        return 0;
    for (size_t j = 0; j < count; j++)
        if (!read_number(buf, &pos, end, &rewards[j]))
            return 0;
    unsigned char *flags[2] = {terminated, truncated};
    for (int f = 0; f < 2; f++) {
        if (!array_of(buf, &pos, end, count) || end - pos < count)
            return 0;
        for (size_t j = 0; j < count; j++, pos++) {
            if ((buf[pos] & 0xfe) != 0xc2)
                return 0;
            flags[f][j] = buf[pos] & 1;
        }
    }
    /* infos: every one {} or nil (nothing to decode), or anything else, spanned for Python */
    size_t at = pos, p = pos;
    int empty = array_of(buf, &p, end, count) && end - p >= count;
    for (size_t j = 0; j < count && empty; j++)
        empty = buf[p + j] == 0x80 || buf[p + j] == 0xc0;
    if (empty) {
        pos = p + count;
        *infos_len = 0;
    } else {
        uint64_t objects = 0; /* vouch() walked these bytes under the caps: a structural walk */
        if (!walk(buf, &pos, end, 1, NULL, &objects))
            return 0;
        *infos_at = at;
        *infos_len = pos - at;
    }
    if (!array_of(buf, &pos, end, count) || end - pos != count)
        return 0;
    for (size_t j = 0; j < count; j++, pos++) /* errors: none */
        if (buf[pos] != 0xc0)
            return 0;
    for (size_t j = 0; j < count; j++)
        if (sent[j] == 1)
            rewards[j] = 0.0, terminated[j] = truncated[j] = 0;
    return 1;
}

static int parse_caps(PyObject *obj, Caps *caps)
{
    caps->slots = 0;
    if (!PyArg_ParseTuple(obj, "KKKKKKKK|K;caps: (max_frame, max_str_len, max_bin_len, max_array_len, max_map_len, "
                               "max_ext_len, max_depth, max_objects[, slots])",
                          &caps->max_frame, &caps->max_str, &caps->max_bin, &caps->max_array, &caps->max_map,
                          &caps->max_ext, &caps->max_depth, &caps->max_objects, &caps->slots))
        return 0;
    if (caps->max_depth > STACK_MAX) {
        PyErr_Format(PyExc_ValueError, "caps: max_depth %llu is over %d", (unsigned long long)caps->max_depth,
                     STACK_MAX);
        return 0;
    }
    return 1;
}

/* --- Batch: what one step() read, held for compose() -------------------------------- */

/* Lane.state */
#define LANE_OUT 0  /* not in this call, or left to Python */
#define LANE_DONE 1 /* a reply vouched for: spliced by compose() */
#define LANE_PARTIAL 2 /* a frame longer than its first read: the rest is read into its reserved place */

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    unsigned char *buf; /* every byte read, lane after lane */
    size_t used, cap;
    Lane *lanes;
    int why;
    long long held;  /* bytes of the lanes done: held until compose() */
    Py_ssize_t done; /* how many */
    PyObject *rest;  /* [(lane, kind, value)]: what Python must finish */
} Batch;

static void batch_dealloc(Batch *self)
{
    PyMem_Free(self->buf);
    PyMem_Free(self->lanes);
    Py_XDECREF(self->rest);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* msgpack's minimal header for an array of n items or a bin of n bytes, as msgpack.Packer writes it. */
static size_t head_size(size_t n, int array)
{
    return n < (array ? 16u : 0u) ? 1 : n < (array ? 0u : 256u) ? 2 : n < 65536 ? 3 : 5;
}

static unsigned char *put_head(unsigned char *p, size_t n, int array)
{
    size_t size = head_size(n, array);
    if (size == 1) {
        *p++ = (unsigned char)(0x90 | n);
        return p;
    }
    *p++ = size == 2 ? 0xc4 : array ? (size == 3 ? 0xdc : 0xdd) : (size == 3 ? 0xc5 : 0xc6);
    for (int s = 8 * ((int)size - 2); s >= 0; s -= 8)
        *p++ = (unsigned char)((uint64_t)n >> s);
    return p;
}

/* One lane's part of the REPLY: spliced from what its env sent, or Python's override. */
typedef struct {
    const unsigned char *obs, *info;
    size_t obs_len, info_len;
    double reward;
    int terminated, truncated;
} Part;

/* overrides[i] = (obs msgpack bytes, reward, terminated, truncated, info msgpack bytes), or an error. */
static PyObject *take_override(PyObject *overrides, Py_ssize_t i, Part *part)
{
    PyObject *key = PyLong_FromSsize_t(i);
    if (key == NULL)
        return NULL;
    PyObject *item = PyDict_GetItemWithError(overrides, key); /* borrowed */
    Py_DECREF(key);
    if (item == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "compose: lane %zd was not completed by step() and has no override", i);
        return NULL;
    }
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 5 || !PyBytes_Check(PyTuple_GET_ITEM(item, 0)) ||
        !PyBytes_Check(PyTuple_GET_ITEM(item, 4))) {
        PyErr_Format(PyExc_TypeError, "compose: lane %zd's override is not (obs bytes, reward, terminated, "
                                      "truncated, info bytes)", i);
        return NULL;
    }
    Py_INCREF(item); /* a tuple: its bytes stay as they are while it is held */
    part->obs = (const unsigned char *)PyBytes_AS_STRING(PyTuple_GET_ITEM(item, 0));
    part->obs_len = (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(item, 0));
    part->info = (const unsigned char *)PyBytes_AS_STRING(PyTuple_GET_ITEM(item, 4));
    part->info_len = (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(item, 4));
    part->reward = PyFloat_AsDouble(PyTuple_GET_ITEM(item, 1));
    part->terminated = PyObject_IsTrue(PyTuple_GET_ITEM(item, 2));
    part->truncated = PyObject_IsTrue(PyTuple_GET_ITEM(item, 3));
    if ((part->reward == -1.0 && PyErr_Occurred()) || part->terminated < 0 || part->truncated < 0) {
        Py_DECREF(item);
        return NULL;
    }
    return item;
}

PyDoc_STRVAR(compose_doc,
"compose(overrides, stragglers) -> bytes\n\n"
"The msgpack of step()'s result [obs list, rewards bin (n float64 LE),\n"
"terminated bin, truncated bin, infos list, stragglers], with each lane done\n"
"here spliced from the bytes its env sent, and every other lane i from\n"
"overrides[i] = (obs msgpack bytes, reward, terminated, truncated, info\n"
"msgpack bytes). stragglers: the msgpack bytes of the stragglers list.");

static PyObject *batch_compose(Batch *self, PyObject *args)
{
    PyObject *overrides, *result = NULL, **held = NULL;
    Py_buffer strag;
    if (!PyArg_ParseTuple(args, "O!y*:compose", &PyDict_Type, &overrides, &strag))
        return NULL;
    Py_ssize_t n = self->n, taken = 0;
    Part *parts = PyMem_Calloc((size_t)n + 1, sizeof(Part));
    held = PyMem_Calloc((size_t)n + 1, sizeof(PyObject *));
    if (parts == NULL || held == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    /* Pass 1: every lane's part (overrides checked and held), and the size. */
    size_t size = 1 + 2 * head_size((size_t)n, 1) + head_size(8 * (size_t)n, 0) + 8 * (size_t)n +
                  2 * (head_size((size_t)n, 0) + (size_t)n) + (size_t)strag.len;
    for (Py_ssize_t i = 0; i < n; i++) {
        Lane *l = &self->lanes[i];
        Part *part = &parts[i];
        if (l->state == LANE_DONE) {
            part->obs = self->buf + l->obs;
            part->obs_len = l->obs_len;
            part->info = self->buf + l->info;
            part->info_len = l->info_len;
            part->reward = l->reward;
            part->terminated = l->terminated;
            part->truncated = l->truncated;
        } else {
            held[taken] = take_override(overrides, i, part);
            if (held[taken] == NULL)
                goto out;
            taken++;
        }
        size += part->obs_len + part->info_len;
    }
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (result == NULL)
        goto out;
    /* Pass 2: the bytes, in the order of the result's items. */
    unsigned char *start = (unsigned char *)PyBytes_AS_STRING(result), *p = start;
    *p++ = 0x96;
    p = put_head(p, (size_t)n, 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(p, parts[i].obs, parts[i].obs_len);
        p += parts[i].obs_len;
    }
    p = put_head(p, 8 * (size_t)n, 0);
    for (Py_ssize_t i = 0; i < n; i++, p += 8)
        memcpy(p, &parts[i].reward, 8); /* array('d').tobytes(): the host's order, as the client reads it */
    p = put_head(p, (size_t)n, 0);
    for (Py_ssize_t i = 0; i < n; i++)
        *p++ = (unsigned char)parts[i].terminated;
    p = put_head(p, (size_t)n, 0);
    for (Py_ssize_t i = 0; i < n; i++)
        *p++ = (unsigned char)parts[i].truncated;
    p = put_head(p, (size_t)n, 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(p, parts[i].info, parts[i].info_len);
        p += parts[i].info_len;
    }
    memcpy(p, strag.buf, (size_t)strag.len);
    p += strag.len;
    if ((size_t)(p - start) != size) { /* a bug here, never the env's doing */
        PyErr_SetString(PyExc_SystemError, "compose: the REPLY's size was miscounted");
        Py_CLEAR(result);
    }
out:
    for (Py_ssize_t k = 0; k < taken; k++)
        Py_DECREF(held[k]);
    PyMem_Free(held);
    PyMem_Free(parts);
    PyBuffer_Release(&strag);
    return result;
}

/* A writable buffer of exactly `size` bytes (a C-contiguous numpy array), or 0 with TypeError. */
static int out_buffer(PyObject *obj, Py_buffer *view, size_t size, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return 0;
    if ((size_t)view->len != size) {
        PyErr_Format(PyExc_ValueError, "groups: %s holds %zd bytes, not %zu", name, view->len, size);
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(groups_doc,
"groups(sent, k, rewards, terminated, truncated) -> list or None\n\n"
"A grouped pool's step read whole: when every lane completed and each is its\n"
"group's plain answer to `sent` (bytes, the kind sent to each env: 0 stepped,\n"
"1 reset; lane g holds envs g*k up to k of them), its obs in its slot, each\n"
"env's reward and flags go into rewards (float64), terminated and truncated\n"
"(bool) at its index (a reset env's 0.0, False, False), and the result is one\n"
"item per lane: None where every member's info is empty, else the msgpack\n"
"bytes of its infos item, for Python to decode and check. None, with the\n"
"arrays' contents undefined, when any lane is otherwise: compose() as ever.");

static PyObject *batch_groups(Batch *self, PyObject *args)
{
    Py_buffer sent;
    Py_ssize_t k;
    PyObject *objs[3], *result = NULL;
    Py_buffer views[3];
    int held = 0;
    if (!PyArg_ParseTuple(args, "y*nOOO:groups", &sent, &k, &objs[0], &objs[1], &objs[2]))
        return NULL;
    size_t envs = (size_t)sent.len;
    if (k < 1 || self->n < 1 || (size_t)(self->n - 1) * (size_t)k >= envs || (size_t)self->n * (size_t)k < envs) {
        PyErr_Format(PyExc_ValueError, "groups: %zd lanes of k = %zd do not hold %zu envs", self->n, k, envs);
        goto out;
    }
    const size_t sizes[3] = {8 * envs, envs, envs};
    const char *names[3] = {"rewards", "terminated", "truncated"};
    for (; held < 3; held++)
        if (!out_buffer(objs[held], &views[held], sizes[held], names[held]))
            goto out;
    result = PyList_New(self->n);
    if (result == NULL)
        goto out;
    double *rewards = (double *)views[0].buf;
    for (Py_ssize_t g = 0; g < self->n; g++) {
        size_t first = (size_t)g * (size_t)k, count = envs - first < (size_t)k ? envs - first : (size_t)k;
        size_t at = 0, len = 0;
        const Lane *lane = &self->lanes[g];
        if (lane->state != LANE_DONE ||
            !group_whole(self->buf, lane, (const unsigned char *)sent.buf + first, count, rewards + first,
                         (unsigned char *)views[1].buf + first, (unsigned char *)views[2].buf + first, &at, &len)) {
            Py_CLEAR(result);
            result = Py_None;
            Py_INCREF(result);
            goto out;
        }
        PyObject *item = len ? PyBytes_FromStringAndSize((const char *)self->buf + at, (Py_ssize_t)len) : Py_None;
        if (item == NULL) {
            Py_CLEAR(result);
            goto out;
        }
        if (!len)
            Py_INCREF(item);
        PyList_SET_ITEM(result, g, item);
    }
out:
    while (held > 0)
        PyBuffer_Release(&views[--held]);
    PyBuffer_Release(&sent);
    return result;
}

static PyMethodDef batch_methods[] = {
    {"compose", (PyCFunction)batch_compose, METH_VARARGS, compose_doc},
    {"groups", (PyCFunction)batch_groups, METH_VARARGS, groups_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef batch_members[] = {
    {"why", T_INT, offsetof(Batch, why), READONLY, "why step() returned: DONE, TIMEOUT, FOREIGN, SHORT_WRITE or BUDGET"},
    {"held", T_LONGLONG, offsetof(Batch, held), READONLY, "bytes held for the lanes done, until compose()"},
    {"done", T_PYSSIZET, offsetof(Batch, done), READONLY, "how many lanes step() completed"},
    {"rest", T_OBJECT, offsetof(Batch, rest), READONLY,
     "[(lane, kind, value)] for Python to finish: (PENDING, None) nothing read yet, (UNUSUAL, bytes read), "
     "(EOF, b''), (SHORT_WRITE_KIND, the frame's bytes not written)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "boltzlabs.worker._fastpath.Batch",
    .tp_basicsize = sizeof(Batch),
    .tp_dealloc = (destructor)batch_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "What one step() call read: the lanes it completed (spliced by compose()) and the rest.",
    .tp_methods = batch_methods,
    .tp_members = batch_members,
};

/* Room for `more` bytes after Batch.used (buf may move: lanes hold offsets).
 * -1 when malloc refuses: with MemoryError set if `strict`, else quietly. */
static int reserve(Batch *b, size_t more, int strict)
{
    if (b->cap - b->used >= more)
        return 0;
    size_t cap = b->cap ? 2 * b->cap : 4 * READ_SIZE;
    while (cap - b->used < more)
        cap *= 2;
    unsigned char *grown = PyMem_Realloc(b->buf, cap);
    if (grown == NULL) {
        if (strict)
            PyErr_NoMemory();
        return -1;
    }
    b->buf = grown;
    b->cap = cap;
    return 0;
}

static int rest_add(Batch *b, Py_ssize_t lane, int kind, PyObject *value) /* steals value */
{
    if (value == NULL)
        return -1;
    PyObject *item = Py_BuildValue("(niN)", lane, kind, value);
    if (item == NULL)
        return -1;
    int r = PyList_Append(b->rest, item);
    Py_DECREF(item);
    return r;
}

/* The `size` bytes at Batch.buf + base that lane read: kept for compose()
 * when `vouched` (vouch() filled in the lane's offsets, relative to base),
 * else handed back to Python as (UNUSUAL, the bytes). -1 on an error. */
static int settle(Batch *b, Py_ssize_t lane, size_t base, size_t size, int vouched)
{
    Lane *l = &b->lanes[lane];
    if (!vouched) {
        l->state = LANE_OUT;
        return rest_add(b, lane, KIND_UNUSUAL, PyBytes_FromStringAndSize((const char *)b->buf + base, (Py_ssize_t)size));
    }
    l->obs += base;
    l->info += base;
    l->state = LANE_DONE;
    b->held += (long long)size;
    b->done++;
    return 0;
}

static size_t uint_size(uint64_t v) { return v < 128 ? 1 : v < 256 ? 2 : v < 65536 ? 3 : v < ((uint64_t)1 << 32) ? 5 : 9; }

static unsigned char *put_uint(unsigned char *p, uint64_t v) /* msgpack's minimal form, as msgpack.Packer */
{
    size_t size = uint_size(v);
    if (size == 1) {
        *p++ = (unsigned char)v;
        return p;
    }
    *p++ = size == 2 ? 0xcc : size == 3 ? 0xcd : size == 5 ? 0xce : 0xcf;
    for (int s = 8 * ((int)size - 2); s >= 0; s -= 8)
        *p++ = (unsigned char)(v >> s);
    return p;
}

PyDoc_STRVAR(step_doc,
"step(epfd, rfds, wfds, actions, seq, resets, deadline, caps, budget, ordered=False) -> Batch or None\n\n"
"The synchronous step of an ungated pool in one call. actions: one msgpack\n"
"array of n actions (the worker's packer's). For every lane with rfds[i] >= 0:\n"
"write [STEP, seq, actions[i], False] (or [RESET, seq, None, None] where\n"
"resets[i]) framed as wire.encode does to wfds[i], then wait on epfd until\n"
"each has answered (a frame longer than one read is read whole), the\n"
"deadline passes, a foreign fd is ready or the bytes read pass budget. A\n"
"reply walk() vouches for is done (Batch.compose splices it); every other\n"
"lane is in Batch.rest. caps: (max_frame,\n"
"max_str_len, max_bin_len, max_array_len, max_map_len, max_ext_len, max_depth,\n"
"max_objects) of the env limits. None, with nothing written, when actions is\n"
"not an array of n values walk() can split. ordered: until the deadline, wait\n"
"on the first lane still out alone (poll), not on epfd: for an epfd that\n"
"holds only the lanes (a lent step; no foreign fd is seen before the deadline).");

static PyObject *step(PyObject *self, PyObject *args)
{
    int epfd;
    PyObject *rfds_obj, *wfds_obj, *caps_obj;
    Py_buffer actions, resets;
    unsigned long long seq;
    double deadline;
    long long budget;
    int ordered = 0; /* wait for the lanes in order, each alone (wait_lane): the lent step's */
    Caps caps;
    if (!PyArg_ParseTuple(args, "iO!O!y*Ky*dO!L|p:step", &epfd, &PyList_Type, &rfds_obj, &PyList_Type,
                          &wfds_obj, &actions, &seq, &resets, &deadline, &PyTuple_Type, &caps_obj, &budget,
                          &ordered))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(rfds_obj);
    Batch *batch = NULL;
    int *rfds = NULL, *wfds = NULL, *lane_of = NULL;
    size_t *act = NULL, *frame_at = NULL;
    unsigned char *frames = NULL;
    struct epoll_event *events = NULL;
    int max_fd = -1, max_events;
    Py_ssize_t waiting = 0;
    long long read_total = 0;
    PyObject *ret = NULL;

    if (!parse_caps(caps_obj, &caps))
        goto done;
    if (PyList_GET_SIZE(wfds_obj) != n || resets.len != n) {
        PyErr_Format(PyExc_ValueError, "step: %zd rfds, %zd wfds and %zd reset flags", n,
                     PyList_GET_SIZE(wfds_obj), resets.len);
        goto done;
    }
    rfds = PyMem_Malloc(sizeof(int) * (size_t)(n + 1));
    wfds = PyMem_Malloc(sizeof(int) * (size_t)(n + 1));
    act = PyMem_Malloc(sizeof(size_t) * 2 * (size_t)(n + 1)); /* each action's start and end */
    frame_at = PyMem_Malloc(sizeof(size_t) * (size_t)(n + 1));
    if (rfds == NULL || wfds == NULL || act == NULL || frame_at == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long r = PyLong_AsLong(PyList_GET_ITEM(rfds_obj, i)), w = PyLong_AsLong(PyList_GET_ITEM(wfds_obj, i));
        if ((r == -1 || w == -1) && PyErr_Occurred())
            goto done;
        if (r < -1 || r >= (1L << 24) || (r >= 0 && (w < 0 || w >= (1L << 24)))) {
            PyErr_Format(PyExc_ValueError, "step: lane %zd has fds %ld/%ld", i, r, w);
            goto done;
        }
        rfds[i] = (int)r;
        wfds[i] = (int)w;
        if (r > max_fd)
            max_fd = (int)r;
    }
    /* Split the actions: one array of n values (the worker's own packing; walked, bounded, all the same). */
    {
        const unsigned char *a = actions.buf;
        size_t pos = 0, end = (size_t)actions.len;
        uint64_t count = 0, none = 0;
        if (!array_head(a, &pos, end, &count) || count != (uint64_t)n)
            goto refuse;
        for (Py_ssize_t i = 0; i < n; i++) {
            act[2 * i] = pos;
            if (!walk(a, &pos, end, 1, NULL, &none))
                goto refuse;
            act[2 * i + 1] = pos;
        }
        if (pos != end)
            goto refuse;
    }
    /* Every lane's frame, built as wire.encode builds it, in one buffer. */
    {
        size_t total = 0, seq_size = uint_size(seq);
        for (Py_ssize_t i = 0; i < n; i++)
            if (rfds[i] >= 0)
                total += 4 + 2 + seq_size + (((unsigned char *)resets.buf)[i] ? 2 : act[2 * i + 1] - act[2 * i] + 1);
        frames = PyMem_Malloc(total ? total : 1);
        if (frames == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        unsigned char *p = frames;
        for (Py_ssize_t i = 0; i < n; i++) {
            frame_at[i] = (size_t)(p - frames);
            if (rfds[i] < 0)
                continue;
            int reset = ((unsigned char *)resets.buf)[i] != 0;
            size_t body = 2 + seq_size + (reset ? 2 : act[2 * i + 1] - act[2 * i] + 1);
            for (int s = 0; s < 32; s += 8)
                *p++ = (unsigned char)(body >> s);
            *p++ = 0x94;
            *p++ = reset ? W_RESET : W_STEP;
            p = put_uint(p, seq);
            if (reset) {
                *p++ = 0xc0;
                *p++ = 0xc0;
            } else {
                memcpy(p, (const unsigned char *)actions.buf + act[2 * i], act[2 * i + 1] - act[2 * i]);
                p += act[2 * i + 1] - act[2 * i];
                *p++ = 0xc2; /* gated: False (a gated pool never comes here) */
            }
        }
        frame_at[n] = (size_t)(p - frames);
    }
    lane_of = PyMem_Malloc(sizeof(int) * (size_t)(max_fd + 2));
    batch = PyObject_New(Batch, &BatchType);
    if (batch != NULL) { /* every field set before anything can fail: batch_dealloc reads them */
        batch->n = n;
        batch->buf = NULL;
        batch->used = batch->cap = 0;
        batch->why = DONE;
        batch->held = 0;
        batch->done = 0;
        batch->lanes = PyMem_Calloc((size_t)(n + 1), sizeof(Lane));
        batch->rest = PyList_New(0);
    }
    if (lane_of == NULL || batch == NULL || batch->lanes == NULL || batch->rest == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    for (int fd = 0; fd <= max_fd; fd++)
        lane_of[fd] = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rfds[i] < 0)
            continue;
        if (lane_of[rfds[i]] >= 0) {
            PyErr_Format(PyExc_ValueError, "step: fd %d is given for lanes %d and %zd", rfds[i], lane_of[rfds[i]], i);
            goto done;
        }
        lane_of[rfds[i]] = (int)i;
    }

    /* Fan-out: one write per lane (an error other than EAGAIN counts as written: EOF or the pidfd says why). */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rfds[i] < 0)
            continue;
        waiting++;
        const unsigned char *data = frames + frame_at[i];
        size_t size = frame_at[i + 1] - frame_at[i], sent = write_all(wfds[i], data, size);
        if (sent < size) {
            if (rest_add(batch, i, KIND_SHORT_WRITE,
                         PyBytes_FromStringAndSize((const char *)data + sent, (Py_ssize_t)(size - sent))) < 0)
                goto done;
            lane_of[rfds[i]] = -1; /* Python finishes it */
            rfds[i] = -1;
            waiting--;
            batch->why = SHORT_WRITE;
        }
    }
    if (batch->why == SHORT_WRITE)
        goto finish;

    /* Fan-in: each lane read (a long frame until whole), vouched for or handed back. */
    max_events = n + 16 < MAX_EVENTS ? (int)n + 16 : MAX_EVENTS;
    events = PyMem_Malloc(sizeof(struct epoll_event) * (size_t)max_events);
    if (events == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double fan_in_start = monotonic_now();
    int rounds = 0, looked = 0;
    while (waiting > 0) {
        int ready = 0;
        if (ordered && !looked) {
            Py_ssize_t first = 0; /* the first lane still out: its fd still maps to it */
            while (first < n && !(rfds[first] >= 0 && rfds[first] <= max_fd && lane_of[rfds[first]] == (int)first))
                first++;
            ready = first < n ? wait_lane(rfds[first], deadline) : 0;
            if (ready < 0)
                goto done;
            if (ready > 0) {
                events[0].data.fd = rfds[first];
                events[0].events = EPOLLIN;
            }
        } else if (rounds++ > 0 && waiting > NAP_MIN_WAITING && nap(fan_in_start, deadline) < 0)
            goto done;
        if (ready == 0) /* past the deadline in order: wait_ready's one look at every lane */
            ready = wait_ready(epfd, events, max_events, deadline, &looked);
        if (ready < 0)
            goto done;
        if (ready == 0) {
            batch->why = TIMEOUT;
            break;
        }
        int foreign = 0, stop = 0;
        for (int e = 0; e < ready && !stop; e++) {
            int fd = events[e].data.fd;
            int lane = fd >= 0 && fd <= max_fd ? lane_of[fd] : -1;
            if (lane < 0 || (events[e].events & EPOLLOUT)) {
                foreign = 1;
                continue;
            }
            Lane *l = &batch->lanes[lane];
            int reset = ((unsigned char *)resets.buf)[lane] != 0;
            if (l->state == LANE_PARTIAL) {
                /* The rest of a long frame: exactly what is missing, into its place. */
                unsigned char *at = batch->buf + l->start;
                ssize_t got = read(fd, at + l->have, l->want - l->have);
                if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
                    continue;
                if (got <= 0) { /* end of file mid-frame: Python takes the part and finds the end itself */
                    lane_of[fd] = -1;
                    waiting--;
                    if (settle(batch, lane, l->start, l->have, 0) < 0)
                        goto done;
                    continue;
                }
                l->have += (size_t)got; /* read_total counted the whole frame when it was reserved */
                if (l->have == l->want) {
                    lane_of[fd] = -1;
                    waiting--;
                    if (settle(batch, lane, l->start, l->want, vouch(at, l->want, &caps, reset, seq, l)) < 0)
                        goto done;
                }
                continue;
            }
            if (reserve(batch, READ_SIZE, 1) < 0)
                goto done;
            unsigned char *at = batch->buf + batch->used;
            ssize_t got = read(fd, at, READ_SIZE);
            if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
                continue;
            if (got <= 0) {
                lane_of[fd] = -1; /* read once: a second event for it is foreign */
                waiting--;
                if (rest_add(batch, lane, KIND_EOF, PyBytes_FromStringAndSize(NULL, 0)) < 0)
                    goto done;
                continue;
            }
            read_total += got;
            uint64_t want = got >= 4 ? 4 + body_length(at) : 0;
            if (want > (uint64_t)got && want - 4 <= caps.max_frame &&
                (long long)want <= budget - (read_total - got) && reserve(batch, (size_t)want, 0) == 0) {
                /* A frame longer than this read (an image, say): its whole size
                 * is reserved here and counted against the budget at once (so
                 * what all lanes reserve stays within it), and the rest is read
                 * into it as the env writes it. A reservation malloc refuses
                 * leaves the lane to Python, as before. */
                l->start = batch->used;
                l->have = (size_t)got;
                l->want = (size_t)want;
                l->state = LANE_PARTIAL;
                batch->used += (size_t)want;
                read_total += (long long)want - got; /* the whole frame counts against the budget now */
                continue;
            }
            lane_of[fd] = -1; /* read once: a second event for it is foreign */
            waiting--;
            /* The hot path: a reply vouched for, kept as read (else its bytes go back and the space is reused). */
            int vouched = read_total <= budget && vouch(at, (size_t)got, &caps, reset, seq, l);
            if (settle(batch, lane, batch->used, (size_t)got, vouched) < 0)
                goto done;
            if (vouched)
                batch->used += (size_t)got;
            if (read_total > budget) {
                batch->why = BUDGET;
                stop = 1;
            }
        }
        if (stop)
            break;
        if (foreign) {
            batch->why = FOREIGN;
            break;
        }
    }
finish:
    for (Py_ssize_t i = 0; i < n; i++) /* the lanes not read whole: pending, or the part read */
        if (rfds[i] >= 0 && rfds[i] <= max_fd && lane_of[rfds[i]] == (int)i) {
            Lane *l = &batch->lanes[i];
            if (l->state == LANE_PARTIAL) {
                if (settle(batch, i, l->start, l->have, 0) < 0)
                    goto done;
                continue;
            }
            Py_INCREF(Py_None);
            if (rest_add(batch, i, KIND_PENDING, Py_None) < 0)
                goto done;
        }
    ret = (PyObject *)batch;
    batch = NULL;
    goto done;
refuse:
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&actions);
    PyBuffer_Release(&resets);
    PyMem_Free(rfds);
    PyMem_Free(wfds);
    PyMem_Free(act);
    PyMem_Free(frame_at);
    PyMem_Free(frames);
    PyMem_Free(lane_of);
    PyMem_Free(events);
    Py_XDECREF(batch);
    return ret;
}

PyDoc_STRVAR(vouch_doc,
"vouch(frame, reset, seq, caps) -> None or (obs bytes, reward, terminated, truncated, info bytes)\n\n"
"What step() makes of one read: the reply's parts when it vouches for it\n"
"(wire.decode and check_reply would accept it as the reply due), else None.\n"
"For tests and fuzzing.");

static PyObject *py_vouch(PyObject *self, PyObject *args)
{
    Py_buffer view;
    int reset;
    unsigned long long seq;
    PyObject *caps_obj;
    Caps caps;
    Lane lane;
    if (!PyArg_ParseTuple(args, "y*pKO!:vouch", &view, &reset, &seq, &PyTuple_Type, &caps_obj))
        return NULL;
    PyObject *ret = NULL;
    if (!parse_caps(caps_obj, &caps))
        goto out;
    /* A copy of exactly the bytes given: ASan sees any read past them. */
    unsigned char *copy = PyMem_Malloc(view.len ? (size_t)view.len : 1);
    if (copy == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    memcpy(copy, view.buf, (size_t)view.len);
    if (vouch(copy, (size_t)view.len, &caps, reset, seq, &lane))
        ret = Py_BuildValue("(y#dNNy#)", (const char *)copy + lane.obs, (Py_ssize_t)lane.obs_len, lane.reward,
                            PyBool_FromLong(lane.terminated), PyBool_FromLong(lane.truncated),
                            (const char *)copy + lane.info, (Py_ssize_t)lane.info_len);
    else {
        ret = Py_None;
        Py_INCREF(ret);
    }
    PyMem_Free(copy);
out:
    PyBuffer_Release(&view);
    return ret;
}

PyDoc_STRVAR(group_reply_doc,
"group_reply(data, seq, caps, sent) -> (rewards, terminated, truncated, infos) or None\n\n"
"vouch() of one STEPPED reply, then what Batch.groups() reads of it as the\n"
"reply of a group of len(sent) envs: lists of each member's reward and flags,\n"
"and the infos item's msgpack bytes (None: every info empty); None where\n"
"groups() leaves it to Python. For tests and fuzzing.");

static PyObject *py_group_reply(PyObject *self, PyObject *args)
{
    Py_buffer view, sent;
    unsigned long long seq;
    PyObject *caps_obj, *ret = NULL;
    Caps caps;
    Lane lane;
    if (!PyArg_ParseTuple(args, "y*KO!y*:group_reply", &view, &seq, &PyTuple_Type, &caps_obj, &sent))
        return NULL;
    size_t count = (size_t)sent.len;
    /* Copies of exactly the bytes given, and arrays of exactly count: ASan sees any access past them. */
    unsigned char *copy = PyMem_Malloc(view.len ? (size_t)view.len : 1);
    double *rewards = PyMem_Malloc(count ? count * sizeof(double) : 1);
    unsigned char *flags = PyMem_Malloc(count ? 2 * count : 1);
    if (copy == NULL || rewards == NULL || flags == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if (!parse_caps(caps_obj, &caps))
        goto out;
    memcpy(copy, view.buf, (size_t)view.len);
    size_t at = 0, len = 0;
    if (!vouch(copy, (size_t)view.len, &caps, 0, seq, &lane) ||
        !group_whole(copy, &lane, (const unsigned char *)sent.buf, count, rewards, flags, flags + count, &at, &len)) {
        ret = Py_None;
        Py_INCREF(ret);
        goto out;
    }
    PyObject *r = PyList_New((Py_ssize_t)count), *te = PyList_New((Py_ssize_t)count),
             *tr = PyList_New((Py_ssize_t)count);
    for (size_t j = 0; r && te && tr && j < count; j++) {
        PyList_SET_ITEM(r, j, PyFloat_FromDouble(rewards[j]));
        PyList_SET_ITEM(te, j, PyBool_FromLong(flags[j]));
        PyList_SET_ITEM(tr, j, PyBool_FromLong(flags[count + j]));
    }
    if (r && te && tr)
        ret = len ? Py_BuildValue("(NNNy#)", r, te, tr, (const char *)copy + at, (Py_ssize_t)len)
                  : Py_BuildValue("(NNNO)", r, te, tr, Py_None);
    else {
        Py_XDECREF(r);
        Py_XDECREF(te);
        Py_XDECREF(tr);
    }
out:
    PyMem_Free(copy);
    PyMem_Free(rewards);
    PyMem_Free(flags);
    PyBuffer_Release(&view);
    PyBuffer_Release(&sent);
    return ret;
}

PyDoc_STRVAR(keep_heap_doc,
"keep_heap() -> bool\n\n"
"Ask glibc's malloc to serve blocks under 32 MiB from the heap and to keep up\n"
"to 128 MiB of it once freed (mallopt M_MMAP_THRESHOLD and M_TRIM_THRESHOLD).\n"
"With big observations the worker allocates and frees the same megabytes\n"
"every step (the replies read, the REPLY composed, its frame); given back to\n"
"the kernel each time, every 4 KiB of them faulted in again on the next step\n"
"(44% of the worker's CPU at n = 256 image envs, docs/performance.md). The\n"
"worker calls it once, at start (server.Worker); an env never imports this\n"
"module.\n"
"False where the C library is not glibc or refuses a setting.");

static PyObject *keep_heap(PyObject *self, PyObject *noargs)
{
#ifdef __GLIBC__
    if (mallopt(M_MMAP_THRESHOLD, 32 << 20) && mallopt(M_TRIM_THRESHOLD, 128 << 20))
        Py_RETURN_TRUE;
#endif
    Py_RETURN_FALSE;
}

static PyMethodDef methods[] = {
    {"step", step, METH_VARARGS, step_doc},
    {"keep_heap", keep_heap, METH_NOARGS, keep_heap_doc},
    {"vouch", py_vouch, METH_VARARGS, vouch_doc},
    {"group_reply", py_group_reply, METH_VARARGS, group_reply_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "boltzlabs.worker._fastpath",
    "The worker's step fan-out and fan-in in C: see native/fastpath.c.", -1, methods,
};

PyMODINIT_FUNC PyInit__fastpath(void)
{
    if (PyType_Ready(&BatchType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    struct { const char *name; long value; } constants[] = {
        {"EOF", KIND_EOF}, {"UNUSUAL", KIND_UNUSUAL}, {"SHORT_WRITE_KIND", KIND_SHORT_WRITE},
        {"DONE", DONE}, {"TIMEOUT", TIMEOUT}, {"FOREIGN", FOREIGN}, {"SHORT_WRITE", SHORT_WRITE},
        {"BUDGET", BUDGET}, {"READ_SIZE", READ_SIZE}, {"PENDING", KIND_PENDING},
    };
    for (size_t i = 0; i < sizeof(constants) / sizeof(constants[0]); i++) {
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
