/* The per-event graph update of GraphStore._run_events, compiled.
 *
 * run_events() does what the interpreted loop does, in the same order and on
 * the same Python objects (the store's dict caches, the batch's WriteBatch and
 * overlays, the cached neighbour-list prefixes): an edge upsert between two
 * nodes already read is applied here; any other event goes to the `slow`
 * callable. rank_bytes() is the sampling rank of graph_state.sampler, BLAKE2b
 * (RFC 7693) with an 8-byte digest over "{seed}:{v}:{u}".
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ BLAKE2b-64 */

static const uint64_t B2_IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t B2_SIGMA[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t x = 0;
    for (int i = 7; i >= 0; i--) x = (x << 8) | p[i];
    return x;
}

static inline void store_be64(uint8_t *p, uint64_t x) {
    for (int i = 7; i >= 0; i--, x >>= 8) p[i] = (uint8_t)x;
}

#define B2_G(a, b, c, d, x, y)            \
    do {                                  \
        v[a] = v[a] + v[b] + (x);         \
        v[d] = rotr64(v[d] ^ v[a], 32);   \
        v[c] = v[c] + v[d];               \
        v[b] = rotr64(v[b] ^ v[c], 24);   \
        v[a] = v[a] + v[b] + (y);         \
        v[d] = rotr64(v[d] ^ v[a], 16);   \
        v[c] = v[c] + v[d];               \
        v[b] = rotr64(v[b] ^ v[c], 63);   \
    } while (0)

static void b2_compress(uint64_t h[8], const uint8_t block[128], uint64_t counter, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++) m[i] = load_le64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = B2_IV[i];
    }
    v[12] ^= counter; /* inputs here stay far below 2^64 bytes: the high counter word is 0 */
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = B2_SIGMA[r % 10];
        B2_G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        B2_G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        B2_G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        B2_G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        B2_G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        B2_G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        B2_G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        B2_G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* The first 8 digest bytes of BLAKE2b(digest_size=8) of `data`, as the big-endian integer they spell. */
static uint64_t b2_rank(const uint8_t *data, size_t len) {
    uint64_t h[8];
    uint8_t block[128];
    memcpy(h, B2_IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ 8; /* fanout 1, depth 1, no key, 8-byte digest */
    uint64_t counter = 0;
    while (len > 128) {
        counter += 128;
        b2_compress(h, data, counter, 0);
        data += 128;
        len -= 128;
    }
    memset(block, 0, sizeof block);
    memcpy(block, data, len);
    counter += len;
    b2_compress(h, block, counter, 1);
    uint64_t out = 0; /* digest bytes are h[0] little-endian; read them in order as a big-endian number */
    for (int i = 0; i < 8; i++) out = (out << 8) | ((h[0] >> (8 * i)) & 0xff);
    return out;
}

/* rank(prefix + v + ":" + u) for UTF-8 `v` and `u`; -1 with an exception set on failure. */
static int rank_of(const char *prefix, Py_ssize_t plen, const char *v, Py_ssize_t vlen, const char *u, Py_ssize_t ulen,
                   uint64_t *out) {
    uint8_t small[512];
    size_t len = (size_t)plen + (size_t)vlen + 1 + (size_t)ulen;
    uint8_t *buf = len <= sizeof small ? small : PyMem_Malloc(len);
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(buf, prefix, plen);
    memcpy(buf + plen, v, vlen);
    buf[plen + vlen] = ':';
    memcpy(buf + plen + vlen + 1, u, ulen);
    *out = b2_rank(buf, len);
    if (buf != small) PyMem_Free(buf);
    return 0;
}

static PyObject *py_rank_bytes(PyObject *Py_UNUSED(module), PyObject *args) {
    const char *prefix, *v, *u;
    PyObject *v_name, *u_name;
    Py_ssize_t plen, vlen, ulen;
    if (!PyArg_ParseTuple(args, "y#UU:rank_bytes", &prefix, &plen, &v_name, &u_name)) return NULL;
    if ((v = PyUnicode_AsUTF8AndSize(v_name, &vlen)) == NULL || (u = PyUnicode_AsUTF8AndSize(u_name, &ulen)) == NULL)
        return NULL;
    uint64_t rank;
    if (rank_of(prefix, plen, v, vlen, u, ulen, &rank) < 0) return NULL;
    uint8_t out[8];
    store_be64(out, rank);
    return PyBytes_FromStringAndSize((const char *)out, 8);
}

/* ------------------------------------------------------------------ the event loop */

static PyObject *s_op, *s_src, *s_dst, *s_ts, *s_weight, *s_degree, *s_last_ts, *s_keys, *s_ids, *s_edge_upsert;

typedef struct {
    PyObject *iid, *nodes, *touched, *edges, *stored, *exists_slow, *wb_put, *edge_family, *nbrs_family, *tops,
        *top_of, *initial_top, *initial_degree, *samples, *pending, *event_touches, *degree_changed, *slow;
    const char *prefix;
    Py_ssize_t prefix_len, top_size;
} Ctx;

static PyObject *pair_bytes(uint64_t a, uint64_t b) {
    uint8_t buf[16];
    store_be64(buf, a);
    store_be64(buf + 8, b);
    return PyBytes_FromStringAndSize((const char *)buf, 16);
}

static int as_u64(PyObject *obj, uint64_t *out) {
    unsigned long long x = PyLong_AsUnsignedLongLong(obj);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = x;
    return 0;
}

/* `if ts > node.last_ts: node.last_ts = float(ts)`: 0, or -1 on error. Two floats compare as doubles; anything
 * else (an int time kept by a new node's record) compares as Python compares it. */
static int raise_last_ts(PyObject *node, PyObject *ts_obj, double ts) {
    PyObject *last = PyObject_GetAttr(node, s_last_ts);
    if (last == NULL) return -1;
    int later = PyFloat_CheckExact(last) && PyFloat_CheckExact(ts_obj) ? ts > PyFloat_AS_DOUBLE(last)
                                                                        : PyObject_RichCompareBool(ts_obj, last, Py_GT);
    Py_DECREF(last);
    if (later <= 0) return later;
    PyObject *x = PyFloat_FromDouble(ts);
    if (x == NULL) return -1;
    int rc = PyObject_SetAttr(node, s_last_ts, x);
    Py_DECREF(x);
    return rc;
}

static double attr_double(PyObject *obj, PyObject *name) {
    PyObject *x = PyObject_GetAttr(obj, name);
    if (x == NULL) return -1.0;
    double d = PyFloat_AsDouble(x);
    Py_DECREF(x);
    return d;
}

/* Whether the edge of `key` exists, this batch's writes included: 1, 0 or -1 on error. */
static int edge_exists(Ctx *c, PyObject *key) {
    PyObject *known = PyDict_GetItemWithError(c->edges, key);
    if (known == NULL && PyErr_Occurred()) return -1;
    if (known == NULL || known == Py_None) {
        known = PyDict_GetItemWithError(c->stored, key);
        if (known == NULL && PyErr_Occurred()) return -1;
    }
    if (known != NULL && known != Py_None) return PyObject_IsTrue(known);
    PyObject *r = PyObject_CallOneArg(c->exists_slow, key);
    if (r == NULL) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

static int wb_put(Ctx *c, PyObject *key, PyObject *value, PyObject *family) {
    PyObject *args[3] = {key, value, family};
    PyObject *r = PyObject_Vectorcall(c->wb_put, args, 3, NULL);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* a < b for two index keys */
static int key_less(PyObject *a, PyObject *b) {
    if (PyBytes_CheckExact(a) && PyBytes_CheckExact(b)) {
        Py_ssize_t la = PyBytes_GET_SIZE(a), lb = PyBytes_GET_SIZE(b);
        int cmp = memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), la < lb ? la : lb);
        return cmp < 0 || (cmp == 0 && la < lb);
    }
    return PyObject_RichCompareBool(a, b, Py_LT);
}

static PyObject *list_attr(PyObject *obj, PyObject *name) {
    PyObject *x = PyObject_GetAttr(obj, name);
    if (x != NULL && !PyList_Check(x)) {
        PyErr_Format(PyExc_TypeError, "expected a list in the prefix's %U", name);
        Py_CLEAR(x);
    }
    return x;
}

static int drop_last(PyObject *list) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    return PyList_SetSlice(list, n - 1, n, NULL);
}

/* GraphStore._add_nbr: add u to N(v); the rank position it took (or 2^62), -1 on error. */
static long long add_nbr(Ctx *c, PyObject *v_obj, uint64_t v, PyObject *v_name, PyObject *u_obj, PyObject *u_name,
                         PyObject *node) {
    long long pos = -1;
    PyObject *top = NULL, *held = NULL, *ids = NULL, *key = NULL, *value = NULL, *inner = NULL, *deg = NULL;
    top = PyDict_GetItemWithError(c->tops, v_obj);
    if (top == Py_None) top = NULL;
    if (top != NULL) {
        Py_INCREF(top);
        int seen = PyDict_Contains(c->initial_top, v_obj);
        if (seen < 0) goto done;
        if (!seen) { /* the prefix as it was before this batch, with the record at hand */
            PyObject *snapshot = NULL;
            ids = list_attr(top, s_ids);
            if (ids == NULL || (snapshot = PyList_GetSlice(ids, 0, PyList_GET_SIZE(ids))) == NULL) goto done;
            int rc = PyDict_SetItem(c->initial_top, v_obj, snapshot);
            Py_DECREF(snapshot);
            if (rc < 0 || (deg = PyObject_GetAttr(node, s_degree)) == NULL) goto done;
            if (PyDict_SetItem(c->initial_degree, v_obj, deg) < 0) goto done;
            Py_CLEAR(deg);
            Py_CLEAR(ids);
        }
    } else {
        if (PyErr_Occurred() || (top = PyObject_CallOneArg(c->top_of, v_obj)) == NULL) goto done;
    }
    if ((held = list_attr(top, s_keys)) == NULL || (ids = list_attr(top, s_ids)) == NULL) goto done;
    Py_ssize_t vlen, ulen;
    const char *vs = PyUnicode_AsUTF8AndSize(v_name, &vlen);
    const char *us = vs == NULL ? NULL : PyUnicode_AsUTF8AndSize(u_name, &ulen);
    uint64_t rank, u;
    if (us == NULL || rank_of(c->prefix, c->prefix_len, vs, vlen, us, ulen, &rank) < 0 || as_u64(u_obj, &u) < 0) goto done;
    if ((key = PyBytes_FromStringAndSize(NULL, 16 + ulen)) == NULL) goto done;
    uint8_t *k = (uint8_t *)PyBytes_AS_STRING(key);
    store_be64(k, v);
    store_be64(k + 8, rank);
    memcpy(k + 16, us, ulen);
    if ((deg = PyObject_GetAttr(node, s_degree)) == NULL) goto done;
    long long degree = PyLong_AsLongLong(deg);
    if (degree == -1 && PyErr_Occurred()) goto done;
    Py_CLEAR(deg);
    int truncated = PyList_GET_SIZE(held) < degree;
    if ((deg = PyLong_FromLongLong(degree + 1)) == NULL || PyObject_SetAttr(node, s_degree, deg) < 0) goto done;
    uint8_t raw[8];
    store_be64(raw, u);
    if ((value = PyBytes_FromStringAndSize((const char *)raw, 8)) == NULL || wb_put(c, key, value, c->nbrs_family) < 0)
        goto done;
    if ((inner = PyObject_GetItem(c->pending, v_obj)) == NULL || PyObject_SetItem(inner, key, u_obj) < 0) goto done;
    Py_ssize_t n = PyList_GET_SIZE(held);
    if (truncated) {
        if (n == 0) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            goto done;
        }
        int after = key_less(PyList_GET_ITEM(held, n - 1), key);
        if (after < 0) goto done;
        if (after) {
            pos = 1LL << 62;
            goto done;
        }
    }
    Py_ssize_t lo = 0, hi = n; /* bisect_left */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        int less = key_less(PyList_GET_ITEM(held, mid), key);
        if (less < 0) goto done;
        if (less) lo = mid + 1;
        else hi = mid;
    }
    int memo = PyDict_Contains(c->samples, v_obj); /* the memoised samples of v are out of date */
    if (memo < 0 || (memo && PyDict_DelItem(c->samples, v_obj) < 0)) goto done;
    if (PyList_Insert(held, lo, key) < 0 || PyList_Insert(ids, lo, u_obj) < 0) goto done;
    if (PyList_GET_SIZE(held) > c->top_size && (drop_last(held) < 0 || drop_last(ids) < 0)) goto done;
    pos = lo;
done:
    Py_XDECREF(top);
    Py_XDECREF(held);
    Py_XDECREF(ids);
    Py_XDECREF(key);
    Py_XDECREF(value);
    Py_XDECREF(inner);
    Py_XDECREF(deg);
    return pos;
}

static int touch_append(PyObject *touches, PyObject *iid, long long pos) {
    PyObject *p = PyLong_FromLongLong(pos);
    if (p == NULL) return -1;
    PyObject *pair = PyTuple_Pack(2, iid, p);
    Py_DECREF(p);
    if (pair == NULL) return -1;
    int rc = PyList_Append(touches, pair);
    Py_DECREF(pair);
    return rc;
}

/* One edge upsert between the read nodes s and d: 0, or -1 on error. */
static int upsert(Ctx *c, PyObject *ev, PyObject *src, PyObject *dst, PyObject *s_obj, PyObject *d_obj, PyObject *sn,
                  PyObject *dn, PyObject *ts_obj, double ts, PyObject *touches) {
    int rc = -1;
    PyObject *key = NULL, *record = NULL, *back = NULL;
    if (raise_last_ts(sn, ts_obj, ts) < 0 || raise_last_ts(dn, ts_obj, ts) < 0) return -1;
    if (PySet_Add(c->touched, s_obj) < 0 || PySet_Add(c->touched, d_obj) < 0) return -1;
    uint64_t s, d;
    if (as_u64(s_obj, &s) < 0 || as_u64(d_obj, &d) < 0 || (key = pair_bytes(s, d)) == NULL) return -1;
    int existed = edge_exists(c, key);
    if (existed < 0) goto done;
    double weight = attr_double(ev, s_weight);
    if (weight == -1.0 && PyErr_Occurred()) goto done;
    uint64_t wbits, tbits;
    memcpy(&wbits, &weight, 8);
    memcpy(&tbits, &ts, 8);
    if ((record = pair_bytes(wbits, tbits)) == NULL || wb_put(c, key, record, c->edge_family) < 0) goto done;
    if (PyDict_SetItem(c->edges, key, Py_True) < 0) goto done;
    if (!existed && s != d) {
        if ((back = pair_bytes(d, s)) == NULL) goto done;
        int reverse = edge_exists(c, back);
        if (reverse < 0) goto done;
        if (!reverse) {
            long long pos = add_nbr(c, s_obj, s, src, d_obj, dst, sn);
            if (pos < 0 || touch_append(touches, s_obj, pos) < 0) goto done;
            pos = add_nbr(c, d_obj, d, dst, s_obj, src, dn);
            if (pos < 0 || touch_append(touches, d_obj, pos) < 0) goto done;
            if (PySet_Add(c->degree_changed, s_obj) < 0 || PySet_Add(c->degree_changed, d_obj) < 0) goto done;
        }
    }
    rc = 0;
done:
    Py_XDECREF(key);
    Py_XDECREF(record);
    Py_XDECREF(back);
    return rc;
}

/* A new reference to the dict value for `key`, or NULL (absent or None; -1 in *err on error). */
static PyObject *known(PyObject *dict, PyObject *key, int *err) {
    PyObject *x = PyDict_GetItemWithError(dict, key);
    if (x == NULL && PyErr_Occurred()) *err = 1;
    if (x == NULL || x == Py_None) return NULL;
    Py_INCREF(x);
    return x;
}

/* One event: the fast path for an edge upsert between two nodes already read, else `slow`. */
static int one_event(Ctx *c, PyObject *ev, double *max_ts) {
    int rc = -1, err = 0;
    PyObject *touches = NULL, *ts_obj = NULL, *op = NULL, *src = NULL, *dst = NULL;
    PyObject *s = NULL, *d = NULL, *sn = NULL, *dn = NULL;
    if ((touches = PyList_New(0)) == NULL || PyList_Append(c->event_touches, touches) < 0) goto done;
    if ((ts_obj = PyObject_GetAttr(ev, s_ts)) == NULL) goto done;
    double ts = PyFloat_AsDouble(ts_obj);
    if (ts == -1.0 && PyErr_Occurred()) goto done;
    if (ts > *max_ts) *max_ts = ts;
    if ((op = PyObject_GetAttr(ev, s_op)) == NULL) goto done;
    int upsert_op = op == s_edge_upsert || (PyUnicode_Check(op) && PyUnicode_Compare(op, s_edge_upsert) == 0);
    if (upsert_op) { /* the lookups in the interpreted loop's order, each stopping the chain when it finds nothing */
        if ((src = PyObject_GetAttr(ev, s_src)) == NULL) goto done;
        if ((s = known(c->iid, src, &err)) != NULL) {
            if ((dst = PyObject_GetAttr(ev, s_dst)) == NULL) goto done;
            if ((d = known(c->iid, dst, &err)) != NULL && (sn = known(c->nodes, s, &err)) != NULL)
                dn = known(c->nodes, d, &err);
        }
        if (err) goto done;
    }
    if (dn != NULL) {
        if (upsert(c, ev, src, dst, s, d, sn, dn, ts_obj, ts, touches) < 0) goto done;
    } else {
        PyObject *r = PyObject_CallFunctionObjArgs(c->slow, ev, touches, NULL);
        if (r == NULL) goto done;
        Py_DECREF(r);
    }
    rc = 0;
done:
    Py_XDECREF(touches);
    Py_XDECREF(ts_obj);
    Py_XDECREF(op);
    Py_XDECREF(src);
    Py_XDECREF(dst);
    Py_XDECREF(s);
    Py_XDECREF(d);
    Py_XDECREF(sn);
    Py_XDECREF(dn);
    return rc;
}

static PyObject *py_run_events(PyObject *Py_UNUSED(module), PyObject *args) {
    Ctx c;
    PyObject *events;
    double max_ts;
    if (!PyArg_ParseTuple(args, "OO!O!O!O!O!OOOOO!OO!O!O!Oy#nO!O!Od:run_events", &events, &PyDict_Type, &c.iid,
                          &PyDict_Type, &c.nodes, &PySet_Type, &c.touched, &PyDict_Type, &c.edges, &PyDict_Type,
                          &c.stored, &c.exists_slow, &c.wb_put, &c.edge_family, &c.nbrs_family, &PyDict_Type, &c.tops,
                          &c.top_of, &PyDict_Type, &c.initial_top, &PyDict_Type, &c.initial_degree, &PyDict_Type,
                          &c.samples, &c.pending, &c.prefix, &c.prefix_len, &c.top_size, &PyList_Type,
                          &c.event_touches, &PySet_Type, &c.degree_changed, &c.slow, &max_ts))
        return NULL;
    PyObject *it = PyObject_GetIter(events), *ev; /* as `for ev in events` */
    if (it == NULL) return NULL;
    for (unsigned long i = 1; (ev = PyIter_Next(it)) != NULL; i++) {
        int rc = one_event(&c, ev, &max_ts);
        Py_DECREF(ev);
        if (rc < 0 || (i % 256 == 0 && PyErr_CheckSignals() < 0)) { /* Ctrl-C need not wait for the batch */
            Py_DECREF(it);
            return NULL;
        }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? NULL : PyFloat_FromDouble(max_ts);
}

static PyMethodDef methods[] = {
    {"rank_bytes", py_rank_bytes, METH_VARARGS,
     "rank_bytes(prefix, v, u): BLAKE2b-64 of prefix + v + ':' + u (UTF-8), 8 big-endian bytes."},
    {"run_events", py_run_events, METH_VARARGS,
     "Apply a validated batch's events in order (GraphStore._run_events); returns the latest event time."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "graph_state._eventloop",
    .m_doc = "The graph store's per-event update, compiled.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__eventloop(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {{&s_op, "op"},         {&s_src, "src"},         {&s_dst, "dst"},   {&s_ts, "ts"},
                 {&s_weight, "weight"}, {&s_degree, "degree"},   {&s_last_ts, "last_ts"},
                 {&s_keys, "keys"},     {&s_ids, "ids"},         {&s_edge_upsert, "edge_upsert"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if ((*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) return NULL;
    }
    return PyModule_Create(&module);
}
