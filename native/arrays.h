/* The wire's array header (wire.check_array_header), in C: shared by
 * native/fastpath.c (the worker's step, which vouches for env replies) and
 * native/wire.c (boltzlabs._wire, the ext hook that decodes them).
 *
 * ARRAY_EXT payload: u16 little-endian header length h, then h bytes of ASCII
 * "<dtype.str>:<dim>,<dim>,..." padded with spaces, then the C-order bytes.
 * The bytes come from an untrusted env: every length is checked against what
 * is left before it is used, every product against MAX_ARRAY_BYTES before it
 * can overflow.
 */
#ifndef BOLTZLABS_ARRAYS_H
#define BOLTZLABS_ARRAYS_H

#include <stdint.h>

#define MAX_NDIM 32                         /* wire._MAX_NDIM */
#define MAX_ARRAY_BYTES ((uint64_t)1 << 40) /* wire._MAX_ARRAY_BYTES */

/* What a header says, for a caller that builds the array. */
typedef struct {
    const unsigned char *dtype; /* the dtype text ("<f8"), not NUL-terminated */
    uint64_t dtype_len;
    uint64_t itemsize, start, nbytes;
    int ndim;
    uint64_t shape[MAX_NDIM];
} ArrayHeader;

/* wire.check_array_header, exactly (and `shape == ()` for a scalar): 1 if
 * it would accept d[0:len] (filling *out when it is not NULL), else 0. */
static inline int array_header_ok_out(const unsigned char *d, uint64_t len, int scalar, ArrayHeader *out)
{
    if (len < 2)
        return 0;
    uint64_t head = (uint64_t)d[0] | ((uint64_t)d[1] << 8), start = 2 + head;
    if (start > len)
        return 0;
    const unsigned char *t = d + 2;
    uint64_t tl = head, colon = 0;
    for (uint64_t i = 0; i < tl; i++)
        if (t[i] >= 0x80) /* .decode("ascii") */
            return 0;
    while (tl > 0 && t[tl - 1] == ' ') /* .rstrip(" ") */
        tl--;
    while (colon < tl && t[colon] != ':')
        colon++;
    if (colon == tl || colon < 3 || colon > 4 || (t[0] != '<' && t[0] != '>' && t[0] != '|'))
        return 0;
    uint64_t itemsize = 0;
    for (uint64_t i = 2; i < colon; i++) {
        if (t[i] < '0' || t[i] > '9')
            return 0;
        itemsize = itemsize * 10 + (uint64_t)(t[i] - '0');
    }
    switch (t[1]) { /* wire._NUMERIC */
    case 'b': if (itemsize != 1) return 0; break;
    case 'i': case 'u': if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) return 0; break;
    case 'f': if (itemsize != 2 && itemsize != 4 && itemsize != 8 && itemsize != 16) return 0; break;
    case 'c': if (itemsize != 8 && itemsize != 16 && itemsize != 32) return 0; break;
    default: return 0;
    }
    /* The dims: "" (shape ()) or 1 to 32 comma-separated runs of 1 to 19 decimal digits. */
    uint64_t nbytes = itemsize, virtual = itemsize, i = colon + 1;
    int ndim = 0;
    if (i < tl) {
        for (;;) {
            uint64_t dim = 0, digits = 0;
            while (i < tl && t[i] != ',') {
                if (t[i] < '0' || t[i] > '9' || ++digits > 19)
                    return 0;
                dim = dim * 10 + (uint64_t)(t[i] - '0'); /* 19 digits < 2**64 */
                i++;
            }
            if (digits == 0 || ++ndim > MAX_NDIM)
                return 0;
            uint64_t factor = dim ? dim : 1;
            if (factor > MAX_ARRAY_BYTES / virtual) /* virtual * factor > 2**40, without overflowing */
                return 0;
            virtual *= factor;
            nbytes = dim ? nbytes * dim : 0; /* nbytes <= virtual: no overflow */
            if (out)
                out->shape[ndim - 1] = dim;
            if (i == tl)
                break;
            i++; /* the comma: a dimension must follow it */
            if (i == tl)
                return 0;
        }
    }
    if (scalar && ndim)
        return 0;
    if (nbytes != len - start)
        return 0;
    if (out) {
        out->dtype = t;
        out->dtype_len = colon;
        out->itemsize = itemsize;
        out->start = start;
        out->nbytes = nbytes;
        out->ndim = ndim;
    }
    return 1;
}

static inline int array_header_ok(const unsigned char *d, uint64_t len, int scalar)
{
    return array_header_ok_out(d, len, scalar, NULL);
}

#endif
