/* STARE's per-loss-call selection on the host in one pass and two small selections (baselines/stare.py).
 *
 * The same sets and the same bits as the NumPy and torch paths of baselines/stare.py (tests run every
 * STARE selection test on all three): members of T+ (T-) are the flat positions i with A_i * mask_i > 0
 * (< 0) in A's dtype; each is ranked by its float32 surprisal |min(log pi, 0)| (NaN above infinity),
 * ties to the earlier position; k = min(n, max(1, int(n P + 0.999999))) of n members, none for P = 0.
 *
 * Why C: on a micro-batch (~10,000 positions) NumPy's cost is its per-call overhead, about twenty
 * calls per set; here one pass classifies the positions and builds the keys, and each set's k-th
 * largest key is found by a quickselect on a sample, then on the members at or above the sample's
 * threshold. Built as an optional extension (pyproject.toml); without a C compiler the NumPy path runs.
 *
 * Keys: (surprisal bits << 32) | (0xFFFFFFFF - position), unique, larger = selected first. Non-negative
 * float32 bits order like the floats, NaN's above infinity's, as in the torch path's keys.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* float32 surprisal bits of one log-prob: |min(x, 0)| as the torch path computes it (clamp then abs). */
static inline uint32_t surprisal_bits(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    uint32_t mag = b & 0x7FFFFFFFu;
    if (b & 0x80000000u) return mag;      /* -0.0, negative, -inf, NaN with the sign bit: |x| */
    return mag > 0x7F800000u ? mag : 0u;  /* NaN stays NaN; +0.0, above 0, +inf: surprisal 0 */
}

static inline uint64_t make_key(uint32_t s, Py_ssize_t i) {
    return ((uint64_t)s << 32) | (uint64_t)(0xFFFFFFFFu - (uint32_t)i);
}

static inline Py_ssize_t key_pos(uint64_t u) { return (Py_ssize_t)(0xFFFFFFFFu - (uint32_t)u); }

/* The official count of selected tokens among n candidates (baselines.stare._k). */
static Py_ssize_t count_k(double P, Py_ssize_t n) {
    if (n == 0 || !(P > 0.0)) return 0;
    double v = (double)n * P + 0.999999;
    Py_ssize_t k = (Py_ssize_t)v;
    if (k < 1) k = 1;
    return k < n ? k : n;
}

/* The r-th largest (r = 0 for the largest) of x[0..n), which it reorders. Quickselect with a
 * median-of-three pivot; keys are unique. Falls back to sorting after too many rounds. */
static int cmp_desc(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? 1 : (x > y ? -1 : 0);
}

static uint64_t select_desc(uint64_t *x, Py_ssize_t n, Py_ssize_t r) {
    Py_ssize_t lo = 0, hi = n - 1, rounds = 0;
    while (hi > lo) {
        if (++rounds > 64) {
            qsort(x + lo, (size_t)(hi - lo + 1), sizeof *x, cmp_desc);
            return x[r];
        }
        Py_ssize_t mid = lo + (hi - lo) / 2;
        uint64_t a = x[lo], b = x[mid], c = x[hi], piv;
        if ((a >= b) == (b >= c)) piv = b;
        else if ((b >= a) == (a >= c)) piv = a;
        else piv = c;
        Py_ssize_t i = lo, j = hi;
        while (i <= j) { /* descending: larger first */
            while (x[i] > piv) i++;
            while (x[j] < piv) j--;
            if (i <= j) {
                uint64_t t = x[i]; x[i] = x[j]; x[j] = t;
                i++; j--;
            }
        }
        if (r <= j) hi = j;
        else if (r >= i) lo = i;
        else return x[r];
    }
    return x[r];
}

/* The cut: the k-th largest key of the n members in keys (0 < k < n). scratch holds n keys. On more
 * than 1024 members a threshold from every 8th member first narrows the candidates to those at or
 * above it; if at least k remain, the k largest are among them (every member left out ranks below). */
static uint64_t kth_key(const uint64_t *keys, Py_ssize_t n, Py_ssize_t k, uint64_t *scratch) {
    if (n > 1024) {
        Py_ssize_t ns = 0;
        for (Py_ssize_t i = 0; i < n; i += 8) scratch[ns++] = keys[i];
        Py_ssize_t q = (Py_ssize_t)((double)ns * (double)k / (double)n * 1.5) + 4;
        if (q > ns) q = ns;
        uint64_t t = select_desc(scratch, ns, q - 1);
        Py_ssize_t nc = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (keys[i] >= t) scratch[nc++] = keys[i];
        if (nc >= k) return select_desc(scratch, nc, k - 1);
    }
    memcpy(scratch, keys, (size_t)n * sizeof *keys);
    return select_desc(scratch, n, k - 1);
}

typedef struct {
    Py_buffer a, lp, m;
    int a_double, lp_double;
    Py_ssize_t n;
} Inputs;

static void release(Inputs *in) {
    if (in->a.obj) PyBuffer_Release(&in->a);
    if (in->lp.obj) PyBuffer_Release(&in->lp);
    if (in->m.obj) PyBuffer_Release(&in->m);
}

/* 1 = double, 0 = float, -1 = neither (with an exception set). */
static int float_kind(Py_buffer *b, const char *name) {
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (b->itemsize == 8 && strcmp(f, "d") == 0) return 1;
    if (b->itemsize == 4 && strcmp(f, "f") == 0) return 0;
    PyErr_Format(PyExc_TypeError, "%s: expected a contiguous float32 or float64 buffer", name);
    return -1;
}

static int get_inputs(PyObject *a, PyObject *lp, PyObject *m, Inputs *in) {
    memset(in, 0, sizeof *in);
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT;
    if (PyObject_GetBuffer(a, &in->a, flags) < 0 || PyObject_GetBuffer(lp, &in->lp, flags) < 0 ||
        PyObject_GetBuffer(m, &in->m, flags) < 0)
        goto fail;
    int ka = float_kind(&in->a, "adv"), kl = float_kind(&in->lp, "log_prob"), km = float_kind(&in->m, "mask");
    if (ka < 0 || kl < 0 || km < 0) goto fail;
    if (km != ka) {
        PyErr_SetString(PyExc_TypeError, "mask: expected the advantages' dtype");
        goto fail;
    }
    in->a_double = ka;
    in->lp_double = kl;
    in->n = in->a.len / in->a.itemsize;
    if (in->lp.len / in->lp.itemsize != in->n || in->m.len / in->m.itemsize != in->n) {
        PyErr_SetString(PyExc_ValueError, "adv, log_prob and mask must have the same number of elements");
        goto fail;
    }
    if (in->n >= ((Py_ssize_t)1 << 31)) {
        PyErr_SetString(PyExc_ValueError, "STARE selection supports fewer than 2**31 tokens per call");
        goto fail;
    }
    return 0;
fail:
    release(in);
    return -1;
}

typedef struct {
    uint64_t *pos, *neg; /* members' keys, in position order */
    Py_ssize_t n_pos, n_neg, k_pos, k_neg, n_valid;
    uint64_t cut_pos, cut_neg; /* a member is selected when its key >= the cut */
} Sets;

/* One pass: T+ and (c2) T- with their keys, and the valid tokens; then each set's cut. */
static int select_sets(const Inputs *in, double P, int c2, Sets *s, uint64_t **buf) {
    Py_ssize_t n = in->n;
    memset(s, 0, sizeof *s);
    *buf = (uint64_t *)malloc((size_t)(2 * n + 1) * sizeof(uint64_t));
    if (!*buf) {
        PyErr_NoMemory();
        return -1;
    }
    /* T+ fills the buffer from the front, T- from the back of the first n; the second n is scratch. */
    uint64_t *pos = *buf, *neg_end = *buf + n, *scratch = *buf + n;
    Py_ssize_t np_ = 0, nn = 0, nv = 0;
#define CLASSIFY(TA, TL)                                                          \
    {                                                                             \
        const TA *A = (const TA *)in->a.buf, *M = (const TA *)in->m.buf;          \
        const TL *L = (const TL *)in->lp.buf;                                     \
        for (Py_ssize_t i = 0; i < n; i++) {                                      \
            TA mv = M[i];                                                         \
            nv += (mv != 0);                                                      \
            TA am = A[i] * mv;                                                    \
            if (am > 0) pos[np_++] = make_key(surprisal_bits((float)L[i]), i);    \
            else if (c2 && am < 0) *(neg_end - ++nn) = make_key(surprisal_bits((float)L[i]), i); \
        }                                                                         \
    }
    if (in->a_double && in->lp_double) CLASSIFY(double, double)
    else if (in->a_double) CLASSIFY(double, float)
    else if (in->lp_double) CLASSIFY(float, double)
    else CLASSIFY(float, float)
#undef CLASSIFY
    uint64_t *neg = neg_end - nn; /* in reverse position order */
    s->pos = pos;
    s->neg = neg;
    s->n_pos = np_;
    s->n_neg = nn;
    s->n_valid = nv;
    s->k_pos = count_k(P, np_);
    s->k_neg = c2 ? count_k(P, nn) : 0;
    s->cut_pos = s->k_pos == 0 ? UINT64_MAX : (s->k_pos == np_ ? 0 : kth_key(pos, np_, s->k_pos, scratch));
    s->cut_neg = s->k_neg == 0 ? UINT64_MAX : (s->k_neg == nn ? 0 : kth_key(neg, nn, s->k_neg, scratch));
    return 0;
}

/* select(adv, log_prob, mask, P, c2, out_pos, out_neg) -> (k_pos, k_neg, n_valid): the flat positions of
 * L+ and L- (ascending) written to the int64 buffers out_pos and out_neg, each of at least k(P, N)
 * elements (k grows with the members, so no set selects more). */
static PyObject *py_select(PyObject *self, PyObject *args) {
    PyObject *a, *lp, *m, *po, *no;
    double P;
    int c2;
    if (!PyArg_ParseTuple(args, "OOOdpOO", &a, &lp, &m, &P, &c2, &po, &no)) return NULL;
    Inputs in;
    if (get_inputs(a, lp, m, &in) < 0) return NULL;
    Py_buffer ob[2] = {{0}, {0}};
    uint64_t *buf = NULL;
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(po, &ob[0], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0 ||
        PyObject_GetBuffer(no, &ob[1], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto done;
    for (int j = 0; j < 2; j++) {
        if (ob[j].itemsize != 8 || ob[j].len / 8 < count_k(P, in.n)) {
            PyErr_SetString(PyExc_ValueError, "out_pos, out_neg: int64 buffers of at least k(P, N) elements");
            goto done;
        }
    }
    Sets s;
    if (select_sets(&in, P, c2, &s, &buf) < 0) goto done;
    int64_t *op = (int64_t *)ob[0].buf, *on = (int64_t *)ob[1].buf;
    Py_ssize_t w = 0;
    for (Py_ssize_t i = 0; i < s.n_pos; i++)
        if (s.pos[i] >= s.cut_pos) op[w++] = key_pos(s.pos[i]);
    w = 0;
    for (Py_ssize_t i = s.n_neg - 1; i >= 0; i--) /* back to position order */
        if (s.neg[i] >= s.cut_neg) on[w++] = key_pos(s.neg[i]);
    ret = Py_BuildValue("nnn", s.k_pos, s.k_neg, s.n_valid);
done:
    free(buf);
    for (int j = 0; j < 2; j++)
        if (ob[j].obj) PyBuffer_Release(&ob[j]);
    release(&in);
    return ret;
}

/* scale(adv, log_prob, mask, P, W, M, c2, gate, out) -> (k_pos, k_neg, n_valid): out (adv's dtype, N
 * elements) gets A with L+ scaled by W and L- by M (in A's dtype, as NumPy multiplies) while gate. */
static PyObject *py_scale(PyObject *self, PyObject *args) {
    PyObject *a, *lp, *m, *o;
    double P, W, M;
    int c2, gate;
    if (!PyArg_ParseTuple(args, "OOOdddppO", &a, &lp, &m, &P, &W, &M, &c2, &gate, &o)) return NULL;
    Inputs in;
    if (get_inputs(a, lp, m, &in) < 0) return NULL;
    Py_buffer ob = {0};
    uint64_t *buf = NULL;
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(o, &ob, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto done;
    if (ob.itemsize != in.a.itemsize || ob.len != in.a.len) {
        PyErr_SetString(PyExc_ValueError, "out: the advantages' dtype and size");
        goto done;
    }
    Sets s;
    if (select_sets(&in, P, c2, &s, &buf) < 0) goto done;
    memcpy(ob.buf, in.a.buf, (size_t)in.a.len);
    if (gate) {
#define SCALE(T)                                                                              \
    {                                                                                         \
        T *out = (T *)ob.buf;                                                                 \
        const T w = (T)W, mm = (T)M;                                                          \
        for (Py_ssize_t i = 0; i < s.n_pos; i++)                                              \
            if (s.pos[i] >= s.cut_pos) { Py_ssize_t p = key_pos(s.pos[i]); out[p] = out[p] * w; } \
        for (Py_ssize_t i = 0; i < s.n_neg; i++)                                              \
            if (s.neg[i] >= s.cut_neg) { Py_ssize_t p = key_pos(s.neg[i]); out[p] = out[p] * mm; } \
    }
        if (in.a_double) SCALE(double)
        else SCALE(float)
#undef SCALE
    }
    ret = Py_BuildValue("nnn", s.k_pos, s.k_neg, s.n_valid);
done:
    free(buf);
    if (ob.obj) PyBuffer_Release(&ob);
    release(&in);
    return ret;
}

static PyMethodDef methods[] = {
    {"select", py_select, METH_VARARGS, "L+ and L- positions: select(adv, log_prob, mask, P, c2, out_pos, out_neg)"},
    {"scale", py_scale, METH_VARARGS, "w * A: scale(adv, log_prob, mask, P, W, M, c2, gate, out)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stare_select",
                                    "STARE's host selection in C (baselines/stare.py)", -1, methods};

PyMODINIT_FUNC PyInit__stare_select(void) { return PyModule_Create(&module); }
