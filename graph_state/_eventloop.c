/* The per-event graph update of GraphStore._run_events, compiled.
 *
 * run_events() does what the interpreted loop does, in the same order and on
 * the same Python objects (the store's dict caches, the batch's WriteBatch and
 * overlays, the cached neighbour-list prefixes): an edge upsert between two
 * nodes already read is applied here; any other event goes to the `slow`
 * callable. Neighbour-index keys take their rank from the store's own rank
 * function (graph_state.sampler.seeded_rank_bytes), so there is one definition
 * of the sampling rank.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ the event loop */

static inline void store_be64(uint8_t *p, uint64_t x) {
    for (int i = 7; i >= 0; i--, x >>= 8) p[i] = (uint8_t)x;
}

static PyObject *s_op, *s_src, *s_dst, *s_ts, *s_weight, *s_degree, *s_last_ts, *s_keys, *s_ids, *s_edge_upsert;

typedef struct {
    PyObject *iid, *nodes, *touched, *edges, *stored, *exists_slow, *wb_put, *edge_family, *nbrs_family, *tops,
        *top_of, *initial_top, *initial_degree, *samples, *pending, *event_touches, *degree_changed, *slow;
    PyObject *rank;
    Py_ssize_t top_size;
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
    Py_ssize_t ulen;
    const char *us = PyUnicode_AsUTF8AndSize(u_name, &ulen);
    uint64_t u;
    if (us == NULL || as_u64(u_obj, &u) < 0) goto done;
    PyObject *pair[2] = {v_name, u_name};
    if ((value = PyObject_Vectorcall(c->rank, pair, 2, NULL)) == NULL) goto done;
    if (!PyBytes_Check(value) || PyBytes_GET_SIZE(value) != 8) {
        PyErr_SetString(PyExc_TypeError, "the rank function must return 8 bytes");
        goto done;
    }
    if ((key = PyBytes_FromStringAndSize(NULL, 16 + ulen)) == NULL) goto done;
    uint8_t *k = (uint8_t *)PyBytes_AS_STRING(key);
    store_be64(k, v);
    memcpy(k + 8, PyBytes_AS_STRING(value), 8);
    memcpy(k + 16, us, ulen);
    Py_CLEAR(value);
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
    if (!PyArg_ParseTuple(args, "OO!O!O!O!O!OOOOO!OO!O!O!OOnO!O!Od:run_events", &events, &PyDict_Type, &c.iid,
                          &PyDict_Type, &c.nodes, &PySet_Type, &c.touched, &PyDict_Type, &c.edges, &PyDict_Type,
                          &c.stored, &c.exists_slow, &c.wb_put, &c.edge_family, &c.nbrs_family, &PyDict_Type, &c.tops,
                          &c.top_of, &PyDict_Type, &c.initial_top, &PyDict_Type, &c.initial_degree, &PyDict_Type,
                          &c.samples, &c.pending, &c.rank, &c.top_size, &PyList_Type,
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

/* ------------------------------------------------------------------ the prefixes a batch changed */

/* A growing array of int64. */
typedef struct {
    int64_t *data;
    Py_ssize_t len, cap;
} Buf;

#define BUF_MAX (PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(int64_t))

/* Room for `more` entries: 0, or -1 with MemoryError. */
static int buf_reserve(Buf *b, Py_ssize_t more) {
    if (more > BUF_MAX - b->len) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t need = b->len + more;
    if (need <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 1024;
    while (cap < need) cap = cap > BUF_MAX / 2 ? need : cap * 2;
    int64_t *data = PyMem_Realloc(b->data, (size_t)cap * sizeof(int64_t));
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static PyObject *buf_bytes(Buf *b) {
    return PyByteArray_FromStringAndSize((const char *)b->data, b->len * (Py_ssize_t)sizeof(int64_t));
}

/* The first `width` ids of a prefix list into row[0..width), padded with -1: 0, or -1 on error. */
static int fill_row(int64_t *row, PyObject *ids, Py_ssize_t width) {
    Py_ssize_t i = 0;
    for (; i < width && i < PyList_GET_SIZE(ids); i++) {
        long long x = PyLong_AsLongLong(PyList_GET_ITEM(ids, i));
        if (x == -1 && PyErr_Occurred()) return -1;
        row[i] = x;
    }
    for (; i < width; i++) row[i] = -1;
    return 0;
}

/* Whether `a[:width] != b[:width]` for two lists: 1, 0 or -1 on error. As Python's list comparison, each pair is
 * held while it is compared and the lengths are read again after every comparison (an __eq__ may change them). */
static int head_differs(PyObject *a, PyObject *b, Py_ssize_t width) {
    for (Py_ssize_t i = 0;; i++) {
        int a_end = i >= width || i >= PyList_GET_SIZE(a), b_end = i >= width || i >= PyList_GET_SIZE(b);
        if (a_end || b_end) return a_end != b_end;
        PyObject *x = PyList_GET_ITEM(a, i), *y = PyList_GET_ITEM(b, i);
        if (x == y) continue;
        Py_INCREF(x);
        Py_INCREF(y);
        int eq = PyObject_RichCompareBool(x, y, Py_EQ);
        Py_DECREF(x);
        Py_DECREF(y);
        if (eq <= 0) return eq < 0 ? -1 : 1;
    }
}

/* One node of GraphStore._prefix_changes: appends to the buffers; 0, or -1 on error. */
static int prefix_change(PyObject *v, PyObject *before_top, PyObject *initial_degree, PyObject *nodes, PyObject *tops,
                         PyObject *empty_ids, Py_ssize_t width, Buf *changed, Buf *before, Buf *after, Buf *moved) {
    int rc = -1;
    PyObject *node = NULL, *deg_before = NULL, *after_top = NULL, *deg_after = NULL, *top = NULL;
    node = PyDict_GetItemWithError(nodes, v); /* nodes.get(v) */
    if (node == NULL && PyErr_Occurred()) return -1;
    Py_XINCREF(node);
    deg_before = PyDict_GetItemWithError(initial_degree, v); /* initial_degree[v] */
    if (deg_before == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, v);
        goto done;
    }
    Py_INCREF(deg_before);
    if (node == NULL || node == Py_None) {
        after_top = Py_NewRef(empty_ids);
        deg_after = PyLong_FromLong(0);
    } else {
        top = PyDict_GetItemWithError(tops, v); /* tops.get(v, empty).ids */
        if (top == NULL && PyErr_Occurred()) goto done;
        Py_XINCREF(top);
        after_top = top == NULL ? Py_NewRef(empty_ids) : list_attr(top, s_ids);
        if (after_top == NULL) goto done;
        deg_after = PyObject_GetAttr(node, s_degree);
    }
    if (deg_after == NULL) goto done;
    if (!PyList_Check(before_top)) {
        PyErr_SetString(PyExc_TypeError, "expected a list of ids in the batch's initial prefixes");
        goto done;
    }
    int same_degree = PyObject_RichCompareBool(deg_before, deg_after, Py_EQ);
    if (same_degree < 0) goto done;
    if (!same_degree) {
        if (buf_reserve(moved, 3) < 0) goto done;
        PyObject *parts[] = {v, deg_before, deg_after};
        for (int i = 0; i < 3; i++) {
            long long x = PyLong_AsLongLong(parts[i]);
            if (x == -1 && PyErr_Occurred()) goto done;
            moved->data[moved->len + i] = x;
        }
        moved->len += 3;
    }
    int differs = head_differs(before_top, after_top, width);
    if (differs < 0) goto done;
    if (differs) {
        long long x = PyLong_AsLongLong(v);
        if ((x == -1 && PyErr_Occurred()) || buf_reserve(changed, 1) < 0 || buf_reserve(before, width) < 0 ||
            buf_reserve(after, width) < 0 || fill_row(before->data + before->len, before_top, width) < 0 ||
            fill_row(after->data + after->len, after_top, width) < 0)
            goto done;
        changed->data[changed->len++] = x;
        before->len += width;
        after->len += width;
    }
    rc = 0;
done:
    Py_XDECREF(node);
    Py_XDECREF(deg_before);
    Py_XDECREF(top);
    Py_XDECREF(after_top);
    Py_XDECREF(deg_after);
    return rc;
}

/* The nodes of `initial_top` whose first `width` prefix ids changed, with those ids before and after, and every
 * node whose degree changed: what GraphStore._finish compares, vectorised there from these rows. */
static PyObject *py_prefix_changes(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *initial_top, *initial_degree, *nodes, *tops;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "O!O!O!O!n:prefix_changes", &PyDict_Type, &initial_top, &PyDict_Type,
                          &initial_degree, &PyDict_Type, &nodes, &PyDict_Type, &tops, &width))
        return NULL;
    if (width < 0 || width > BUF_MAX) {
        PyErr_Format(PyExc_ValueError, "width must be between 0 and %zd", BUF_MAX);
        return NULL;
    }
    Buf changed = {0}, before = {0}, after = {0}, moved = {0};
    PyObject *result = NULL, *v, *before_top, *empty_ids = PyList_New(0); /* the ids of a node with no prefix */
    if (empty_ids == NULL) return NULL;
    Py_ssize_t pos = 0, size = PyDict_GET_SIZE(initial_top);
    while (PyDict_Next(initial_top, &pos, &v, &before_top)) {
        Py_INCREF(v);
        Py_INCREF(before_top);
        int rc = prefix_change(v, before_top, initial_degree, nodes, tops, empty_ids, width, &changed, &before, &after,
                               &moved);
        Py_DECREF(v);
        Py_DECREF(before_top);
        if (rc < 0) goto done;
        if (PyDict_GET_SIZE(initial_top) != size) {
            PyErr_SetString(PyExc_RuntimeError, "dictionary changed size during iteration");
            goto done;
        }
    }
    result = PyTuple_New(4);
    Buf *parts[] = {&changed, &before, &after, &moved};
    for (Py_ssize_t i = 0; result != NULL && i < 4; i++) {
        PyObject *part = buf_bytes(parts[i]);
        if (part == NULL) Py_CLEAR(result);
        else PyTuple_SET_ITEM(result, i, part);
    }
done:
    Py_DECREF(empty_ids);
    PyMem_Free(changed.data);
    PyMem_Free(before.data);
    PyMem_Free(after.data);
    PyMem_Free(moved.data);
    return result;
}

static PyMethodDef methods[] = {
    {"run_events", py_run_events, METH_VARARGS,
     "Apply a validated batch's events in order (GraphStore._run_events); returns the latest event time."},
    {"prefix_changes", py_prefix_changes, METH_VARARGS,
     "(changed ids, their first width prefix ids before, after, (v, degree before, after) of moved degrees) as "
     "int64 bytearrays (GraphStore._finish)."},
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
