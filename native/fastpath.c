/* boltzlabs.worker._fastpath: the worker's step fan-out and fan-in in C (issue #16).
 *
 *     worker.step() --frames--> exchange() --write--> every lane's channel (its write fd)
 *                   <--replies- exchange() <--read--- (epoll, with a deadline; its read fd)
 *
 * One call writes each lane's pre-framed request (wire.py's frames: a 4-byte
 * little-endian body length, then the msgpack body), waits on the worker's
 * own epoll set until every lane has answered or the deadline passes, and
 * reads each lane's reply ONCE into a reused buffer. It decodes nothing: the
 * Python side decodes under wire.Limits exactly as before. What this file
 * decides is only which bytes belong to which lane and whether they look like
 * exactly one frame, so everything unusual can go back to the pure-Python
 * path unchanged:
 *
 *   - a read that is exactly one frame (length <= max_frame, body an array led
 *     by a positive fixint, the shape of every message) -> the frame's bytes;
 *   - anything else (a partial frame, several frames, an oversized or garbled
 *     prefix) -> (UNUSUAL, the bytes read), fed to the lane's FrameReader;
 *   - end of file or a read error -> (EOF, b"");
 *   - a short write -> (SHORT_WRITE, bytes sent), and the call returns before
 *     waiting: the caller keeps the rest and the pure path takes over.
 *
 * It returns early, leaving those lanes pending (None), when the epoll set
 * reports any fd that is not one of its lanes (a log pipe, a pidfd, the
 * client's socket, a straggler's channel: the worker's event loop handles
 * them), when the deadline passes, and when the bytes it holds would exceed
 * `budget` (the pool's byte budget, limits.max_pool_bytes, less what the
 * pool holds). Every lane is read at most once per call, so the bytes held
 * are bounded by budget + one read.
 *
 * Everything read here comes from an untrusted env: the only parsing is
 * frame_kind() below, which looks at most at the first 6 bytes of what was
 * read, with every index checked against the length.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

/* Per-lane outcome kinds (the first item of a result tuple). */
#define KIND_EOF 1
#define KIND_UNUSUAL 2
#define KIND_SHORT_WRITE 3

/* Why exchange() returned. */
#define DONE 0
#define TIMEOUT 1
#define FOREIGN 2
#define SHORT_WRITE 3
#define BUDGET 4

/* frame_kind() results. */
#define FRAME_ONE 0     /* exactly one frame, within the cap, message-shaped */
#define FRAME_SHORT 1   /* fewer bytes than the prefix says (or than a prefix) */
#define FRAME_EXTRA 2   /* more bytes than one frame: several frames */
#define FRAME_BIG 3     /* the prefix is over max_frame */
#define FRAME_SHAPE 4   /* one frame whose body does not start as a message */

#define READ_SIZE 65536 /* the pure path's _READ_SIZE */
#define MAX_EVENTS 1024

/* The reused read buffer. Reads happen with the GIL held (only epoll_wait
 * releases it), so one buffer serves every call. */
static unsigned char read_buf[READ_SIZE];

/* Whether buf[0:len] is exactly one frame. Looks at no byte past len. */
static int frame_kind(const unsigned char *buf, size_t len, uint64_t max_frame)
{
    if (len < 4)
        return FRAME_SHORT;
    uint64_t body = (uint64_t)buf[0] | ((uint64_t)buf[1] << 8) | ((uint64_t)buf[2] << 16) |
                    ((uint64_t)buf[3] << 24);
    if (body > max_frame)
        return FRAME_BIG;
    if (len - 4 < body)
        return FRAME_SHORT;
    if (len - 4 > body)
        return FRAME_EXTRA;
    /* The outer shape of every message: an array (fixarray with at least one
     * item, array16, array32) whose first item is a positive fixint code.
     * Anything else is left to the decoder, which names what is wrong. */
    if (body < 2)
        return FRAME_SHAPE;
    unsigned char head = buf[4];
    size_t first;
    if (head > 0x90 && head <= 0x9f)
        first = 5;
    else if (head == 0xdc)
        first = 7;
    else if (head == 0xdd)
        first = 9;
    else
        return FRAME_SHAPE;
    if (first >= len || buf[first] > 0x7f)
        return FRAME_SHAPE;
    return FRAME_ONE;
}

static double monotonic_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of Python's time.monotonic() */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* (kind, value) as a new tuple; steals nothing. */
static PyObject *outcome(int kind, PyObject *value)
{
    return Py_BuildValue("(iO)", kind, value);
}

PyDoc_STRVAR(exchange_doc,
"exchange(epfd, rfds, wfds, frames, deadline, max_frame, budget) -> (why, results)\n\n"
"Write frames[i] (bytes, or None for nothing) to wfds[i], then wait on the epoll\n"
"set epfd until each of rfds has been read once, time.monotonic() reaches deadline,\n"
"an fd that is not in rfds is ready, or the bytes read pass budget. rfds[i] and\n"
"wfds[i] are lane i's channel: one socket (the same fd twice) or two pipes.\n"
"results[i]: None (nothing read yet), bytes (exactly one frame, prefix\n"
"included), or (kind, value): (EOF, b''), (UNUSUAL, bytes read),\n"
"(SHORT_WRITE, bytes written). why: DONE, TIMEOUT, FOREIGN, SHORT_WRITE or BUDGET.");

static PyObject *exchange(PyObject *self, PyObject *args)
{
    int epfd;
    PyObject *fds_obj, *wfds_obj, *frames_obj;
    double deadline;
    unsigned long long max_frame;
    long long budget;
    if (!PyArg_ParseTuple(args, "iO!O!O!dKL:exchange", &epfd, &PyList_Type, &fds_obj, &PyList_Type, &wfds_obj,
                          &PyList_Type, &frames_obj, &deadline, &max_frame, &budget))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(fds_obj);
    if (PyList_GET_SIZE(frames_obj) != n || PyList_GET_SIZE(wfds_obj) != n) {
        PyErr_Format(PyExc_ValueError, "exchange: %zd read fds, %zd write fds and %zd frames", n,
                     PyList_GET_SIZE(wfds_obj), PyList_GET_SIZE(frames_obj));
        return NULL;
    }
    int *fds = NULL, *wfds = NULL, *lane_of = NULL;
    PyObject *results = NULL;
    struct epoll_event *events = NULL;
    int max_fd = -1, why = DONE, max_events;
    Py_ssize_t waiting = n;
    long long held = 0;

    /* Check everything before the first byte is written. */
    fds = PyMem_Malloc(sizeof(int) * (size_t)(n ? n : 1));
    wfds = PyMem_Malloc(sizeof(int) * (size_t)(n ? n : 1));
    if (fds == NULL || wfds == NULL)
        goto nomem;
    for (Py_ssize_t i = 0; i < n; i++) {
        long fd = PyLong_AsLong(PyList_GET_ITEM(fds_obj, i));
        if (fd == -1 && PyErr_Occurred())
            goto fail;
        long wfd = PyLong_AsLong(PyList_GET_ITEM(wfds_obj, i));
        if (wfd == -1 && PyErr_Occurred())
            goto fail;
        /* fds are below RLIMIT_NOFILE, far under 2**24 */
        if (fd < 0 || fd >= (1L << 24) || wfd < 0 || wfd >= (1L << 24)) {
            PyErr_Format(PyExc_ValueError, "exchange: lane %zd has no channel (fds %ld, %ld)", i, fd, wfd);
            goto fail;
        }
        wfds[i] = (int)wfd;
        PyObject *frame = PyList_GET_ITEM(frames_obj, i);
        if (frame != Py_None && !PyBytes_Check(frame)) {
            PyErr_Format(PyExc_TypeError, "exchange: frame %zd is %.100s, not bytes or None", i,
                         Py_TYPE(frame)->tp_name);
            goto fail;
        }
        fds[i] = (int)fd;
        if (fd > max_fd)
            max_fd = (int)fd;
    }
    lane_of = PyMem_Malloc(sizeof(int) * (size_t)(max_fd + 1 > 0 ? max_fd + 1 : 1));
    if (lane_of == NULL)
        goto nomem;
    for (int fd = 0; fd <= max_fd; fd++)
        lane_of[fd] = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (lane_of[fds[i]] >= 0) {
            PyErr_Format(PyExc_ValueError, "exchange: fd %d is given for lanes %d and %zd", fds[i],
                         lane_of[fds[i]], i);
            goto fail;
        }
        lane_of[fds[i]] = (int)i;
    }
    results = PyList_New(n); /* every item None (pending) until its lane is read */
    if (results == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(Py_None);
        PyList_SET_ITEM(results, i, Py_None);
    }

    /* Fan-out: one write per lane. An error other than EAGAIN is ignored as the
     * pure path ignores it: the channel is gone, and EOF or the pidfd says why. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *frame = PyList_GET_ITEM(frames_obj, i);
        if (frame == Py_None)
            continue;
        const char *data = PyBytes_AS_STRING(frame);
        Py_ssize_t size = PyBytes_GET_SIZE(frame), sent = 0;
        while (sent < size) {
            ssize_t w = write(wfds[i], data + sent, (size_t)(size - sent));
            if (w < 0 && errno == EINTR)
                continue;
            if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
                break;
            if (w < 0) {
                sent = size;
                break;
            }
            sent += w;
        }
        if (sent < size) {
            PyObject *count = PyLong_FromSsize_t(sent), *item = NULL;
            if (count != NULL)
                item = outcome(KIND_SHORT_WRITE, count);
            Py_XDECREF(count);
            if (item == NULL)
                goto fail;
            PyList_SetItem(results, i, item);
            why = SHORT_WRITE;
        }
    }
    if (why == SHORT_WRITE)
        goto out;

    /* Fan-in. */
    max_events = n + 16 < MAX_EVENTS ? (int)n + 16 : MAX_EVENTS;
    events = PyMem_Malloc(sizeof(struct epoll_event) * (size_t)max_events);
    if (events == NULL)
        goto nomem;
    while (waiting > 0) {
        double left = deadline - monotonic_now();
        if (!(left > 0)) { /* NaN included: no (int) cast of it below */
            why = TIMEOUT;
            goto out;
        }
        /* Round up: waking a little after the deadline, never before it. */
        double ms = left * 1000.0 + 1.0;
        int timeout = ms > 86400000.0 ? 86400000 : (int)ms;
        int ready;
        Py_BEGIN_ALLOW_THREADS
        ready = epoll_wait(epfd, events, max_events, timeout);
        Py_END_ALLOW_THREADS
        if (ready < 0) {
            if (errno == EINTR) {
                if (PyErr_CheckSignals() < 0) /* e.g. SIGTERM's handler raising */
                    goto fail;
                continue;
            }
            PyErr_SetFromErrno(PyExc_OSError);
            goto fail;
        }
        int foreign = 0;
        for (int e = 0; e < ready; e++) {
            int fd = events[e].data.fd;
            int lane = fd >= 0 && fd <= max_fd ? lane_of[fd] : -1;
            if (lane < 0 || PyList_GET_ITEM(results, lane) != Py_None || (events[e].events & EPOLLOUT)) {
                foreign = 1; /* the event loop's business: it stays ready (level-triggered) */
                continue;
            }
            ssize_t got = read(fd, read_buf, READ_SIZE);
            if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
                continue;
            PyObject *item;
            if (got <= 0) {
                PyObject *empty = PyBytes_FromStringAndSize(NULL, 0);
                if (empty == NULL)
                    goto fail;
                item = outcome(KIND_EOF, empty);
                Py_DECREF(empty);
            } else {
                PyObject *data = PyBytes_FromStringAndSize((const char *)read_buf, got);
                if (data == NULL)
                    goto fail;
                if (frame_kind(read_buf, (size_t)got, max_frame) == FRAME_ONE) {
                    item = data; /* the hot path: one whole reply, handed over as read */
                } else {
                    item = outcome(KIND_UNUSUAL, data);
                    Py_DECREF(data);
                }
                held += got;
            }
            if (item == NULL)
                goto fail;
            PyList_SetItem(results, lane, item);
            waiting--;
            if (held > budget) {
                why = BUDGET;
                goto out;
            }
        }
        if (foreign) {
            why = FOREIGN;
            goto out;
        }
    }
out:
    PyMem_Free(fds);
    PyMem_Free(wfds);
    PyMem_Free(lane_of);
    PyMem_Free(events);
    {
        PyObject *ret = Py_BuildValue("(iN)", why, results);
        return ret;
    }
nomem:
    PyErr_NoMemory();
fail:
    PyMem_Free(fds);
    PyMem_Free(wfds);
    PyMem_Free(lane_of);
    PyMem_Free(events);
    Py_XDECREF(results);
    return NULL;
}

PyDoc_STRVAR(frame_kind_doc,
"frame_kind(data, max_frame) -> int\n\n"
"How exchange() classifies one read: FRAME_ONE (exactly one frame within\n"
"max_frame whose body starts as a message), FRAME_SHORT, FRAME_EXTRA,\n"
"FRAME_BIG or FRAME_SHAPE. For tests and fuzzing.");

static PyObject *py_frame_kind(PyObject *self, PyObject *args)
{
    Py_buffer view;
    unsigned long long max_frame;
    if (!PyArg_ParseTuple(args, "y*K:frame_kind", &view, &max_frame))
        return NULL;
    int kind = frame_kind((const unsigned char *)view.buf, (size_t)view.len, max_frame);
    PyBuffer_Release(&view);
    return PyLong_FromLong(kind);
}

static PyMethodDef methods[] = {
    {"exchange", exchange, METH_VARARGS, exchange_doc},
    {"frame_kind", py_frame_kind, METH_VARARGS, frame_kind_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "boltzlabs.worker._fastpath",
    "The worker's step fan-out and fan-in in C: see native/fastpath.c.", -1, methods,
};

PyMODINIT_FUNC PyInit__fastpath(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    struct { const char *name; long value; } constants[] = {
        {"EOF", KIND_EOF}, {"UNUSUAL", KIND_UNUSUAL}, {"SHORT_WRITE_KIND", KIND_SHORT_WRITE},
        {"DONE", DONE}, {"TIMEOUT", TIMEOUT}, {"FOREIGN", FOREIGN}, {"SHORT_WRITE", SHORT_WRITE},
        {"BUDGET", BUDGET}, {"FRAME_ONE", FRAME_ONE}, {"FRAME_SHORT", FRAME_SHORT},
        {"FRAME_EXTRA", FRAME_EXTRA}, {"FRAME_BIG", FRAME_BIG}, {"FRAME_SHAPE", FRAME_SHAPE},
        {"READ_SIZE", READ_SIZE},
    };
    for (size_t i = 0; i < sizeof(constants) / sizeof(constants[0]); i++) {
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
