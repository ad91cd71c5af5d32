/* boltzlabs._wire: the wire's encoder and ext hook in C (boltzlabs/wire.py says what they do).
 *
 *     env:     serve() --frame(reply)--> bytes            client: --frame([CALL, ..., actions])--> bytes
 *     client:  msgpack.unpackb(REPLY, ext_hook=Hook) --arrays and numpy scalars--> values
 *     env:     msgpack.unpackb(STEP, ext_hook=Hook)  --the action's array--> value
 *
 * A real env's reply is an ndarray, numpy scalars and an info dict; in Python
 * each numpy value costs the packer's `default` hook on one side and the ext
 * hook on the other (12.6 us to encode one HalfCheetah reply). This module
 * does the same work in C and returns exactly what wire.py's Python code
 * returns:
 *
 *   frame(obj) / pack(obj): the bytes wire.encode / wire.pack make (msgpack
 *     with use_bin_type and strict_types, arrays and numpy scalars as
 *     ARRAY_EXT / SCALAR_EXT, tuples as TUPLE_EXT), or None for anything it
 *     does not handle exactly (a subclass, an int past 64 bits, a str that is
 *     not UTF-8, an odd dtype, nesting past 500 levels...): Python then packs
 *     the whole value, and raises what it raises. Encoding reads only the
 *     caller's own values: it runs no Python code and parses nothing.
 *   Hook(check, fallback, ext_type): msgpack's ext_hook. ARRAY_EXT and
 *     SCALAR_EXT headers are checked by arrays.h (wire.check_array_header in
 *     C, fuzzed against it); a header it accepts becomes the read-only numpy
 *     view (or numpy scalar) the Python hook makes, or, in check mode (the
 *     worker), ext_type(code, data) untouched. Everything else, a header it
 *     refuses included, goes to `fallback` (the Python hook), which decodes
 *     tuples under the frame's caps or raises the precise error: the bounds
 *     on untrusted bytes are the Python code's, unchanged.
 *
 * NumPy is imported only when the first array or numpy scalar is decoded; an
 * env that receives one has imported it already.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "arrays.h"

#define ARRAY_EXT 1
#define TUPLE_EXT 2
#define SCALAR_EXT 3
#define MAX_TUPLE_NESTING 32 /* wire.MAX_TUPLE_NESTING */
#define MAX_NEST 500         /* deeper values go to Python's packer (its limit: 511 levels) */

enum { OK = 0, UNSUPPORTED = 1, ERROR = -1 };

static PyObject *ext_type_class; /* msgpack.ExtType */

/* --- the encoder ------------------------------------------------------------------------ */

/* Pass 1 counts (p NULL); pass 2 writes into a bytes object of that size.
 * Nothing runs between the passes but the allocation; if the sizes still
 * disagree (a collector run changed a list, say), `over` says so and Python
 * packs the value instead. */
typedef struct {
    unsigned char *p;
    size_t n, cap;
    int over;
} W;

static inline void put(W *w, const void *src, size_t len)
{
    if (w->p) {
        if (len > w->cap - w->n) {
            w->over = 1;
            return;
        }
        memcpy(w->p + w->n, src, len);
    }
    w->n += len;
}

static inline void put1(W *w, unsigned char c) { put(w, &c, 1); }

static inline void put_be(W *w, unsigned char marker, uint64_t v, int width)
{
    unsigned char b[9];
    b[0] = marker;
    for (int i = 0; i < width; i++)
        b[1 + i] = (unsigned char)(v >> (8 * (width - 1 - i)));
    put(w, b, 1 + (size_t)width);
}

static void put_array_head(W *w, size_t n)
{
    if (n < 16)
        put1(w, (unsigned char)(0x90 | n));
    else if (n < 65536)
        put_be(w, 0xdc, n, 2);
    else
        put_be(w, 0xdd, n, 4);
}

static void put_ext_head(W *w, size_t len, int code)
{
    switch (len) { /* msgpack_pack_ext */
    case 1: put1(w, 0xd4); break;
    case 2: put1(w, 0xd5); break;
    case 4: put1(w, 0xd6); break;
    case 8: put1(w, 0xd7); break;
    case 16: put1(w, 0xd8); break;
    default:
        if (len < 256)
            put_be(w, 0xc7, len, 1);
        else if (len < 65536)
            put_be(w, 0xc8, len, 2);
        else
            put_be(w, 0xc9, len, 4);
    }
    put1(w, (unsigned char)(signed char)code);
}

/* An array's dtype.str from its buffer format (NumPy's buffer export), if it
 * is one of wire._NUMERIC: the kind and size, the byte order ('|' for one
 * byte). 0 for anything else. */
static int dtype_of(const Py_buffer *view, char out[8])
{
    const char *f = view->format ? view->format : "B";
    char order = '<';
    if (*f == '>' || *f == '!') {
        order = '>';
        f++;
    } else if (*f == '<' || *f == '=' || *f == '@')
        f++;
    char kind;
    Py_ssize_t size;
    if (f[0] == 'Z' && f[1] && !f[2]) {
        kind = 'c';
        size = f[1] == 'f' ? 8 : f[1] == 'd' ? 16 : f[1] == 'g' ? 32 : 0;
    } else if (f[0] && !f[1]) {
        switch (f[0]) {
        case '?': kind = 'b'; size = 1; break;
        case 'b': kind = 'i'; size = 1; break;
        case 'B': kind = 'u'; size = 1; break;
        case 'h': kind = 'i'; size = 2; break;
        case 'H': kind = 'u'; size = 2; break;
        case 'i': kind = 'i'; size = 4; break;
        case 'I': kind = 'u'; size = 4; break;
        case 'l': kind = 'i'; size = (Py_ssize_t)sizeof(long); break;
        case 'L': kind = 'u'; size = (Py_ssize_t)sizeof(long); break;
        case 'q': kind = 'i'; size = 8; break;
        case 'Q': kind = 'u'; size = 8; break;
        case 'e': kind = 'f'; size = 2; break;
        case 'f': kind = 'f'; size = 4; break;
        case 'd': kind = 'f'; size = 8; break;
        case 'g': kind = 'f'; size = 16; break;
        default: return 0;
        }
    } else
        return 0;
    /* long double (f16, c32): its padding bytes are whatever the value's copy
     * holds, which Python's np.asarray may make differently: left to Python. */
    if (size == 0 || size != view->itemsize || (kind == 'f' && size == 16) || (kind == 'c' && size == 32))
        return 0;
    snprintf(out, 8, "%c%c%d", size == 1 ? '|' : order, kind, (int)size);
    return 1;
}

/* wire._array_ext: an ndarray (ARRAY_EXT) or a numpy scalar (SCALAR_EXT). */
static int emit_numpy(PyObject *obj, int scalar, W *w)
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        return UNSUPPORTED;
    }
    int ret = UNSUPPORTED;
    char dtype[8];
    char text[2048];
    if (!dtype_of(&view, dtype) || (scalar && view.ndim != 0) || view.ndim > 64 || view.len < 0)
        goto out;
    int tl = snprintf(text, sizeof(text), "%s:", dtype);
    for (int d = 0; d < view.ndim; d++)
        tl += snprintf(text + tl, sizeof(text) - (size_t)tl, d ? ",%zd" : "%zd", view.shape[d]);
    size_t pad = (size_t)((16 - (2 + tl) % 16) % 16), head = (size_t)tl + pad;
    size_t len = 2 + head + (size_t)view.len;
    if (head > 0xffff || len > 0xffffffffu)
        goto out;
    put_ext_head(w, len, scalar ? SCALAR_EXT : ARRAY_EXT);
    unsigned char h[2] = {(unsigned char)(head & 0xff), (unsigned char)(head >> 8)};
    put(w, h, 2);
    put(w, text, (size_t)tl);
    for (size_t i = 0; i < pad; i++)
        put1(w, ' ');
    if (w->p && !w->over) {
        if ((size_t)view.len > w->cap - w->n)
            w->over = 1;
        else if (PyBuffer_IsContiguous(&view, 'C'))
            memcpy(w->p + w->n, view.buf, (size_t)view.len);
        else if (PyBuffer_ToContiguous(w->p + w->n, &view, view.len, 'C') < 0) {
            ret = ERROR;
            goto out;
        }
    }
    w->n += (size_t)view.len;
    ret = OK;
out:
    PyBuffer_Release(&view);
    return ret;
}

static int emit(PyObject *obj, int depth, int tuples, W *w);

static int emit_items(PyObject *const *items, Py_ssize_t n, int depth, int tuples, W *w)
{
    put_array_head(w, (size_t)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        int r = emit(items[i], depth + 1, tuples, w);
        if (r != OK)
            return r;
    }
    return OK;
}

static int emit(PyObject *obj, int depth, int tuples, W *w)
{
    if (depth > MAX_NEST)
        return UNSUPPORTED;
    PyTypeObject *type = Py_TYPE(obj);
    if (obj == Py_None) {
        put1(w, 0xc0);
        return OK;
    }
    if (obj == Py_True || obj == Py_False) {
        put1(w, obj == Py_True ? 0xc3 : 0xc2);
        return OK;
    }
    if (type == &PyLong_Type) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (overflow > 0) {
            unsigned long long u = PyLong_AsUnsignedLongLong(obj);
            if (u == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return UNSUPPORTED; /* past 64 bits: Python's default() raises */
            }
            put_be(w, 0xcf, u, 8);
            return OK;
        }
        if (overflow < 0)
            return UNSUPPORTED;
        if (v == -1 && PyErr_Occurred())
            return ERROR;
        if (v >= 0) {
            if (v < 0x80)
                put1(w, (unsigned char)v);
            else if (v <= 0xff)
                put_be(w, 0xcc, (uint64_t)v, 1);
            else if (v <= 0xffff)
                put_be(w, 0xcd, (uint64_t)v, 2);
            else if (v <= 0xffffffffLL)
                put_be(w, 0xce, (uint64_t)v, 4);
            else
                put_be(w, 0xcf, (uint64_t)v, 8);
        } else {
            if (v >= -0x20)
                put1(w, (unsigned char)(int8_t)v);
            else if (v >= -0x80)
                put_be(w, 0xd0, (uint64_t)v, 1);
            else if (v >= -0x8000)
                put_be(w, 0xd1, (uint64_t)v, 2);
            else if (v >= -0x80000000LL)
                put_be(w, 0xd2, (uint64_t)v, 4);
            else
                put_be(w, 0xd3, (uint64_t)v, 8);
        }
        return OK;
    }
    if (type == &PyFloat_Type) {
        double d = PyFloat_AS_DOUBLE(obj);
        uint64_t bits;
        memcpy(&bits, &d, 8);
        put_be(w, 0xcb, bits, 8);
        return OK;
    }
    if (type == &PyUnicode_Type) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(obj, &n);
        if (s == NULL) {
            PyErr_Clear();
            return UNSUPPORTED; /* surrogates: msgpack raises */
        }
        if ((uint64_t)n > 0xffffffffu)
            return UNSUPPORTED;
        if (n < 32)
            put1(w, (unsigned char)(0xa0 | n));
        else if (n < 256)
            put_be(w, 0xd9, (uint64_t)n, 1);
        else if (n < 65536)
            put_be(w, 0xda, (uint64_t)n, 2);
        else
            put_be(w, 0xdb, (uint64_t)n, 4);
        put(w, s, (size_t)n);
        return OK;
    }
    if (type == &PyBytes_Type || type == &PyByteArray_Type) {
        Py_ssize_t n = type == &PyBytes_Type ? PyBytes_GET_SIZE(obj) : PyByteArray_GET_SIZE(obj);
        const char *s = type == &PyBytes_Type ? PyBytes_AS_STRING(obj) : PyByteArray_AS_STRING(obj);
        if ((uint64_t)n > 0xffffffffu)
            return UNSUPPORTED;
        if (n < 256)
            put_be(w, 0xc4, (uint64_t)n, 1);
        else if (n < 65536)
            put_be(w, 0xc5, (uint64_t)n, 2);
        else
            put_be(w, 0xc6, (uint64_t)n, 4);
        put(w, s, (size_t)n);
        return OK;
    }
    if (type == &PyList_Type)
        return emit_items(((PyListObject *)obj)->ob_item, PyList_GET_SIZE(obj), depth, tuples, w);
    if (type == &PyDict_Type) {
        Py_ssize_t n = PyDict_GET_SIZE(obj), pos = 0;
        if (n < 16)
            put1(w, (unsigned char)(0x80 | n));
        else if (n < 65536)
            put_be(w, 0xde, (uint64_t)n, 2);
        else
            put_be(w, 0xdf, (uint64_t)n, 4);
        PyObject *key, *value;
        Py_ssize_t seen = 0;
        while (PyDict_Next(obj, &pos, &key, &value)) {
            int r = emit(key, depth + 1, tuples, w);
            if (r == OK)
                r = emit(value, depth + 1, tuples, w);
            if (r != OK)
                return r;
            seen++;
        }
        return seen == n ? OK : UNSUPPORTED;
    }
    if (((PyObject *)type == ext_type_class || (PyTuple_Check(obj) && PyType_IsSubtype(type, (PyTypeObject *)ext_type_class)))
        && PyTuple_GET_SIZE(obj) == 2) {
        /* msgpack.ExtType(code, data), or wire.CheckedArray (the worker re-packs what it checked) */
        PyObject *code = PyTuple_GET_ITEM(obj, 0), *data = PyTuple_GET_ITEM(obj, 1);
        if (!PyLong_CheckExact(code) || !PyBytes_CheckExact(data))
            return UNSUPPORTED;
        long c = PyLong_AsLong(code);
        if (c < -128 || c > 127) {
            PyErr_Clear();
            return UNSUPPORTED;
        }
        if ((uint64_t)PyBytes_GET_SIZE(data) > 0xffffffffu)
            return UNSUPPORTED;
        put_ext_head(w, (size_t)PyBytes_GET_SIZE(data), (int)c);
        put(w, PyBytes_AS_STRING(data), (size_t)PyBytes_GET_SIZE(data));
        return OK;
    }
    const char *name = type->tp_name;
    if (strncmp(name, "numpy.", 6) == 0) /* a plain numpy type (wire._default: cls.__module__ == "numpy") */
        return emit_numpy(obj, strcmp(name + 6, "ndarray") != 0, w);
    if (PyTuple_Check(obj)) { /* TUPLE_EXT: the items as a msgpack array, packed the same way */
        if (tuples >= MAX_TUPLE_NESTING)
            return UNSUPPORTED; /* Python raises, naming MAX_TUPLE_NESTING */
        PyObject *const *items = ((PyTupleObject *)obj)->ob_item;
        Py_ssize_t n = PyTuple_GET_SIZE(obj);
        W count = {NULL, 0, 0, 0};
        int r = emit_items(items, n, 0, tuples + 1, &count);
        if (r != OK)
            return r;
        if (count.n > 0xffffffffu)
            return UNSUPPORTED;
        put_ext_head(w, count.n, TUPLE_EXT);
        if (w->p == NULL) { /* counting: the items were just counted (counting them again doubles per level) */
            w->n += count.n;
            return OK;
        }
        size_t before = w->n;
        /* The items start a fresh packer in Python (its own 511 levels): depth 0 here too. */
        r = emit_items(items, n, 0, tuples + 1, w);
        if (r == OK && w->n - before != count.n)
            w->over = 1;
        return r;
    }
    return UNSUPPORTED;
}

/* One value's msgpack bytes, after `prefix` bytes of room (the frame's length). */
static PyObject *encode(PyObject *obj, size_t prefix)
{
    W count = {NULL, 0, 0, 0};
    int r = emit(obj, 0, 0, &count);
    if (r == ERROR)
        return NULL;
    if (r == UNSUPPORTED || (prefix && count.n > 0xffffffffu))
        Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(prefix + count.n));
    if (out == NULL)
        return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (size_t i = 0; i < prefix; i++)
        p[i] = (unsigned char)(count.n >> (8 * i)); /* wire.HEADER: little-endian u32 */
    W w = {p + prefix, 0, count.n, 0};
    r = emit(obj, 0, 0, &w);
    if (r == ERROR) {
        Py_DECREF(out);
        return NULL;
    }
    if (r == UNSUPPORTED || w.over || w.n != count.n) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

PyDoc_STRVAR(frame_doc, "frame(value) -> bytes or None\n\n"
"wire.encode(value): the 4-byte little-endian length and the msgpack body, or\n"
"None when the value holds anything this encoder does not make exactly as\n"
"wire's Python packer does (then that packer must).");

static PyObject *py_frame(PyObject *self, PyObject *obj) { return encode(obj, 4); }

PyDoc_STRVAR(pack_doc, "pack(value) -> bytes or None\n\nwire.pack(value), or None (as frame()).");

static PyObject *py_pack(PyObject *self, PyObject *obj) { return encode(obj, 0); }

/* --- the ext hook ------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    int check;
    PyObject *fallback, *frombuffer, *dtype_class, *dtypes, *scalars;
    PyObject *checked; /* check: what an array becomes (wire.CheckedArray), else NULL: an ExtType */
} Hook;

static void hook_dealloc(Hook *self)
{
    Py_XDECREF(self->fallback);
    Py_XDECREF(self->frombuffer);
    Py_XDECREF(self->dtype_class);
    Py_XDECREF(self->dtypes);
    Py_XDECREF(self->scalars);
    Py_XDECREF(self->checked);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *hook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    int check;
    PyObject *fallback, *checked = NULL;
    if (!PyArg_ParseTuple(args, "pO|O:Hook", &check, &fallback, &checked))
        return NULL;
    if (checked != NULL && (!PyType_Check(checked) || !PyType_IsSubtype((PyTypeObject *)checked,
                                                                         (PyTypeObject *)ext_type_class))) {
        PyErr_SetString(PyExc_TypeError, "Hook: checked must be a subclass of msgpack.ExtType");
        return NULL;
    }
    Hook *self = (Hook *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->check = check;
    Py_INCREF(fallback);
    self->fallback = fallback;
    Py_XINCREF(checked);
    self->checked = checked;
    self->dtypes = PyDict_New();
    self->scalars = PyDict_New();
    if (self->dtypes == NULL || self->scalars == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* np.dtype(text), cached (a handful of dtypes ever come) */
static PyObject *dtype_for(Hook *self, const ArrayHeader *h)
{
    PyObject *key = PyUnicode_FromStringAndSize((const char *)h->dtype, (Py_ssize_t)h->dtype_len);
    if (key == NULL)
        return NULL;
    PyObject *dtype = PyDict_GetItemWithError(self->dtypes, key); /* borrowed */
    if (dtype == NULL && !PyErr_Occurred()) {
        if (self->frombuffer == NULL) {
            PyObject *np = PyImport_ImportModule("numpy");
            if (np == NULL)
                goto fail;
            self->frombuffer = PyObject_GetAttrString(np, "frombuffer");
            self->dtype_class = PyObject_GetAttrString(np, "dtype");
            Py_DECREF(np);
            if (self->frombuffer == NULL || self->dtype_class == NULL) {
                Py_CLEAR(self->frombuffer);
                Py_CLEAR(self->dtype_class);
                goto fail;
            }
        }
        PyObject *made = PyObject_CallOneArg(self->dtype_class, key);
        if (made == NULL)
            goto fail;
        int r = PyDict_SetItem(self->dtypes, key, made);
        Py_DECREF(made);
        if (r < 0)
            goto fail;
        dtype = made; /* the dict holds it */
    }
    Py_DECREF(key);
    return dtype;
fail:
    Py_DECREF(key);
    return NULL;
}

/* A numpy scalar without an array in between, for the common native dtypes:
 * np.float64(x) is what np.frombuffer(data, "<f8")[0] is. NULL with no error
 * set: take the general path. */
static PyObject *fast_scalar(Hook *self, PyObject *dtype, const ArrayHeader *h, const unsigned char *raw)
{
    char order = (char)h->dtype[0], kind = (char)h->dtype[1];
    if (order == '>' && h->itemsize > 1)
        return NULL;
    PyObject *value = NULL;
    switch (kind) {
    case 'b': value = PyBool_FromLong(raw[0] != 0); if (raw[0] > 1) { Py_DECREF(value); return NULL; } break;
    case 'i': {
        int64_t v;
        if (h->itemsize == 1) v = (int8_t)raw[0];
        else if (h->itemsize == 2) { int16_t x; memcpy(&x, raw, 2); v = x; }
        else if (h->itemsize == 4) { int32_t x; memcpy(&x, raw, 4); v = x; }
        else { memcpy(&v, raw, 8); }
        value = PyLong_FromLongLong(v);
        break;
    }
    case 'u': {
        uint64_t v;
        if (h->itemsize == 1) v = raw[0];
        else if (h->itemsize == 2) { uint16_t x; memcpy(&x, raw, 2); v = x; }
        else if (h->itemsize == 4) { uint32_t x; memcpy(&x, raw, 4); v = x; }
        else { memcpy(&v, raw, 8); }
        value = PyLong_FromUnsignedLongLong(v);
        break;
    }
    case 'f':
        if (h->itemsize == 8) {
            double d;
            memcpy(&d, raw, 8);
            value = PyFloat_FromDouble(d);
        } else if (h->itemsize == 4) {
            float f;
            memcpy(&f, raw, 4);
            if (f != f)
                return NULL; /* a NaN's payload could change on the way through a double */
            value = PyFloat_FromDouble((double)f);
        } else
            return NULL;
        break;
    default:
        return NULL;
    }
    if (value == NULL)
        return NULL;
    PyObject *scalar_type = PyDict_GetItemWithError(self->scalars, dtype); /* borrowed */
    if (scalar_type == NULL) {
        if (PyErr_Occurred() || (scalar_type = PyObject_GetAttrString(dtype, "type")) == NULL) {
            Py_DECREF(value);
            return NULL;
        }
        int r = PyDict_SetItem(self->scalars, dtype, scalar_type);
        Py_DECREF(scalar_type);
        if (r < 0) {
            Py_DECREF(value);
            return NULL;
        }
    }
    PyObject *out = PyObject_CallOneArg(scalar_type, value);
    Py_DECREF(value);
    return out;
}

static PyObject *hook_call(Hook *self, PyObject *args, PyObject *kwargs)
{
    int code;
    PyObject *data;
    if (kwargs != NULL || !PyArg_ParseTuple(args, "iO:ext_hook", &code, &data))
        return NULL;
    if ((code != ARRAY_EXT && code != SCALAR_EXT) || !PyBytes_CheckExact(data))
        return PyObject_CallFunctionObjArgs(self->fallback, PyTuple_GET_ITEM(args, 0), data, NULL);
    ArrayHeader h;
    const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(data);
    if (!array_header_ok_out(d, (uint64_t)PyBytes_GET_SIZE(data), code == SCALAR_EXT, &h))
        return PyObject_CallFunctionObjArgs(self->fallback, PyTuple_GET_ITEM(args, 0), data, NULL);
    if (self->check) { /* the worker: the header is checked, the bytes passed on untouched */
        PyObject *made = code == ARRAY_EXT && self->checked != NULL ? self->checked : ext_type_class;
        return PyObject_CallFunctionObjArgs(made, PyTuple_GET_ITEM(args, 0), data, NULL);
    }
    PyObject *dtype = dtype_for(self, &h);
    if (dtype == NULL)
        return NULL;
    if (code == SCALAR_EXT) {
        PyObject *fast = fast_scalar(self, dtype, &h, d + h.start);
        if (fast != NULL || PyErr_Occurred())
            return fast;
    }
    PyObject *offset = PyLong_FromUnsignedLongLong(h.start);
    if (offset == NULL)
        return NULL;
    PyObject *array = PyObject_CallFunction(self->frombuffer, "OOiO", data, dtype, -1, offset);
    Py_DECREF(offset);
    if (array == NULL || code == SCALAR_EXT) {
        if (array == NULL)
            return NULL;
        PyObject *item = PySequence_GetItem(array, 0);
        Py_DECREF(array);
        return item;
    }
    if (h.ndim == 1)
        return array; /* frombuffer's shape is (nbytes / itemsize,) = the one dimension already */
    PyObject *shape = PyTuple_New(h.ndim);
    if (shape == NULL) {
        Py_DECREF(array);
        return NULL;
    }
    for (int i = 0; i < h.ndim; i++) {
        PyObject *dim = PyLong_FromUnsignedLongLong(h.shape[i]);
        if (dim == NULL) {
            Py_DECREF(shape);
            Py_DECREF(array);
            return NULL;
        }
        PyTuple_SET_ITEM(shape, i, dim);
    }
    PyObject *out = PyObject_CallMethod(array, "reshape", "(O)", shape);
    Py_DECREF(shape);
    Py_DECREF(array);
    return out;
}

static PyTypeObject HookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "boltzlabs._wire.Hook",
    .tp_basicsize = sizeof(Hook),
    .tp_dealloc = (destructor)hook_dealloc,
    .tp_call = (ternaryfunc)hook_call,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Hook(check, fallback, checked=None): msgpack's ext_hook for wire.Limits (arrays and numpy "
              "scalars in C; everything else, and any header C refuses, by fallback(code, data)); check: an "
              "array comes back as checked(code, data), an ExtType subclass, or an ExtType.",
    .tp_new = hook_new,
};

static PyMethodDef methods[] = {
    {"frame", py_frame, METH_O, frame_doc},
    {"pack", py_pack, METH_O, pack_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "boltzlabs._wire",
    "The wire's encoder and ext hook in C: see native/wire.c.", -1, methods,
};

PyMODINIT_FUNC PyInit__wire(void)
{
    if (PyType_Ready(&HookType) < 0)
        return NULL;
    PyObject *msgpack = PyImport_ImportModule("msgpack");
    if (msgpack == NULL)
        return NULL;
    ext_type_class = PyObject_GetAttrString(msgpack, "ExtType");
    Py_DECREF(msgpack);
    if (ext_type_class == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&HookType);
    if (PyModule_AddObject(m, "Hook", (PyObject *)&HookType) < 0) {
        Py_DECREF(&HookType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
