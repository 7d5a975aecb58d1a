/* The prefix index's per-block state without a Python object per part of it.
 *
 * Why this file exists: in pure Python a block in the index cost ~300 B of
 * heap (docs/SCALE.md): an Entry object with a GC header (88 B), its 16-byte
 * key as a bytes object (49 B), its offset as an int object (35 B) and a dict
 * slot (42 B+). Here an Entry is one 64-byte object holding its key and its
 * offset inline (the slab allocator rounds it to 64), and a KeyMap is an
 * open-addressing table of Entry pointers keyed by the entry's own key: ~8-21 B
 * per entry at its load of 0.375-0.75. Python sees the same attributes and the
 * same dict API the index used (kvtier/pool/entry.py picks this module, or the
 * pure-Python classes where it was not built).
 *
 * Neither type is tracked by the cyclic garbage collector (that header is 16 B
 * per block). The daemon does not leave garbage cycles among its entries (the
 * index unlinks an entry from the eviction order and its maps before it lets
 * go of it; the daemon freezes its survivors anyway: daemon/tenure.py), so
 * nothing is lost; a whole index dropped with entries in it (a test's) is kept
 * until the process exits.
 *
 * Keys are hashed with SipHash-1-3 under a per-process random key (seed()),
 * so a tenant cannot aim its block hashes at one probe run. Deletion shifts
 * the run back (linear probing, no tombstones): a table at a steady size never
 * rebuilds; it doubles past a load of 3/4.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define KEY_BYTES 16
/* word: bit 0 the state (1: READY), bits 1..19 the pins, bits 20..63 the offset */
#define PIN_BITS 19
#define PIN_MAX ((1ULL << PIN_BITS) - 1)
#define OFF_SHIFT (1 + PIN_BITS)
#define OFF_MAX ((1ULL << (64 - OFF_SHIFT)) - 1)   /* 16 TiB */

static PyObject *WRITING_S, *READY_S;
static uint64_t sip_k0 = 0x736f6d6570736575ULL, sip_k1 = 0x646f72616e646f6dULL;

/* ---- SipHash-1-3 of one 16-byte key ------------------------------------ */
#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND do { \
    v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32); \
    v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2; \
    v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0; \
    v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32); } while (0)

static inline uint64_t hash_key(const uint64_t k[2]) {
    uint64_t v0 = sip_k0 ^ 0x736f6d6570736575ULL, v1 = sip_k1 ^ 0x646f72616e646f6dULL;
    uint64_t v2 = sip_k0 ^ 0x6c7967656e657261ULL, v3 = sip_k1 ^ 0x7465646279746573ULL;
    uint64_t m;
    m = k[0]; v3 ^= m; SIPROUND; v0 ^= m;
    m = k[1]; v3 ^= m; SIPROUND; v0 ^= m;
    m = (uint64_t)KEY_BYTES << 56; v3 ^= m; SIPROUND; v0 ^= m;
    v2 ^= 0xff; SIPROUND; SIPROUND; SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

/* ---- Entry ---------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    PyObject *ns;          /* its Bucket (or None) */
    uint64_t key[2];
    uint64_t word;         /* state, pins, offset */
    PyObject *lp, *ln;     /* neighbours in the eviction order, or None */
} EntryObject;
/* ns, lp and ln are T_OBJECT_EX members, never NULL (None when unset): CPython's
 * specializing interpreter turns a read or a write of one into a direct slot access, as
 * for a Python __slots__ class (a T_OBJECT member or a getset costs a descriptor call:
 * the LRU order's relinking took 2.8x as long). */

static PyTypeObject EntryType;

static PyObject *Entry_new(PyTypeObject *t, PyObject *args, PyObject *kw) {
    EntryObject *e = (EntryObject *)t->tp_alloc(t, 0);
    if (e != NULL) {
        Py_INCREF(Py_None);
        Py_INCREF(Py_None);
        Py_INCREF(Py_None);
        e->ns = e->lp = e->ln = Py_None;
    }
    return (PyObject *)e;
}

static int read_key(PyObject *key, uint64_t out[2]) {
    /* 1: out holds it; 0: not a 16-byte bytes (no error set); -1: error set */
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "a block key is bytes, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    if (PyBytes_GET_SIZE(key) != KEY_BYTES)
        return 0;
    memcpy(out, PyBytes_AS_STRING(key), KEY_BYTES);
    return 1;
}

static int need_key(PyObject *key, uint64_t out[2]) {
    /* read_key where only a 16-byte key will do: 0, or -1 with TypeError / ValueError set */
    int r = read_key(key, out);
    if (r == 0)
        PyErr_Format(PyExc_ValueError, "a block key is %d bytes, got %zd", KEY_BYTES, PyBytes_GET_SIZE(key));
    return r == 1 ? 0 : -1;
}

static inline void put_pins(EntryObject *e, uint64_t pins) {  /* pins in [0, PIN_MAX]: checked by the caller */
    e->word = (e->word & ~(PIN_MAX << 1)) | (pins << 1);
}

static int Entry_init(EntryObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"ns", "key", "offset", NULL};
    PyObject *ns, *key, *off;
    unsigned long long offset;
    if (kw == NULL && PyTuple_GET_SIZE(args) == 3) {  /* the index's own call: no argument parser */
        ns = PyTuple_GET_ITEM(args, 0);
        key = PyTuple_GET_ITEM(args, 1);
        off = PyTuple_GET_ITEM(args, 2);
        if (!PyLong_Check(off)) {
            PyErr_SetString(PyExc_TypeError, "an entry's offset is an int");
            return -1;
        }
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(off, &overflow);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (overflow || v < 0) {
            PyErr_Format(PyExc_OverflowError, "offset %R is not in [0, %llu] (16 TiB)", off,
                         (unsigned long long)OFF_MAX);
            return -1;
        }
        offset = (unsigned long long)v;
    } else if (!PyArg_ParseTupleAndKeywords(args, kw, "OOK", names, &ns, &key, &offset)) {
        return -1;
    }
    if (need_key(key, self->key) < 0)
        return -1;
    if (offset > OFF_MAX) {
        PyErr_Format(PyExc_OverflowError, "offset %llu is past %llu (16 TiB)", offset, (unsigned long long)OFF_MAX);
        return -1;
    }
    Py_INCREF(ns);
    Py_XSETREF(self->ns, ns);
    self->word = (uint64_t)offset << OFF_SHIFT;   /* WRITING, no pins */
    Py_INCREF(Py_None);
    Py_XSETREF(self->lp, Py_None);
    Py_INCREF(Py_None);
    Py_XSETREF(self->ln, Py_None);
    return 0;
}

static void Entry_dealloc(EntryObject *self) {
    Py_XDECREF(self->ns);
    Py_XDECREF(self->lp);
    Py_XDECREF(self->ln);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Entry_get_key(EntryObject *self, void *c) {
    return PyBytes_FromStringAndSize((const char *)self->key, KEY_BYTES);
}

static PyObject *Entry_get_offset(EntryObject *self, void *c) {
    return PyLong_FromUnsignedLongLong(self->word >> OFF_SHIFT);
}

static PyObject *Entry_get_state(EntryObject *self, void *c) {
    PyObject *s = (self->word & 1) ? READY_S : WRITING_S;
    Py_INCREF(s);
    return s;
}

static int Entry_set_state(EntryObject *self, PyObject *v, void *c) {
    int ready;
    if (v == READY_S) ready = 1;
    else if (v == WRITING_S) ready = 0;
    else if (v != NULL && PyUnicode_Check(v) && PyUnicode_Compare(v, READY_S) == 0) ready = 1;
    else if (v != NULL && PyUnicode_Check(v) && PyUnicode_Compare(v, WRITING_S) == 0) ready = 0;
    else {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "an entry's state is 'writing' or 'ready'");
        return -1;
    }
    self->word = (self->word & ~1ULL) | (uint64_t)ready;
    return 0;
}

static PyObject *Entry_get_pins(EntryObject *self, void *c) {
    return PyLong_FromUnsignedLong((unsigned long)((self->word >> 1) & PIN_MAX));
}

static int Entry_set_pins(EntryObject *self, PyObject *v, void *c) {
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "pins cannot be deleted");
        return -1;
    }
    long long n = PyLong_AsLongLong(v);
    if (n == -1 && PyErr_Occurred())
        return -1;
    if (n < 0 || (unsigned long long)n > PIN_MAX) {
        PyErr_Format(PyExc_OverflowError, "pins must be in [0, %llu], got %lld", (unsigned long long)PIN_MAX, n);
        return -1;
    }
    put_pins(self, (uint64_t)n);
    return 0;
}

static PyObject *Entry_repr(EntryObject *self) {
    return PyUnicode_FromFormat("<Entry %s pins=%lu at %llu>", (self->word & 1) ? "ready" : "writing",
                                (unsigned long)((self->word >> 1) & PIN_MAX),
                                (unsigned long long)(self->word >> OFF_SHIFT));
}

static PyGetSetDef Entry_getset[] = {
    {"key", (getter)Entry_get_key, NULL, "the block's 16-byte hash", NULL},
    {"offset", (getter)Entry_get_offset, NULL, "its slot's byte offset in the pool", NULL},
    {"state", (getter)Entry_get_state, (setter)Entry_set_state, "'writing' or 'ready'", NULL},
    {"pins", (getter)Entry_get_pins, (setter)Entry_set_pins, "readers holding it", NULL},
    {NULL}
};

static PyMemberDef Entry_members[] = {
    {"ns", T_OBJECT_EX, offsetof(EntryObject, ns), 0, "its index.Bucket"},
    {"lp", T_OBJECT_EX, offsetof(EntryObject, lp), 0, "the previous entry in the eviction order, or None"},
    {"ln", T_OBJECT_EX, offsetof(EntryObject, ln), 0, "the next entry in the eviction order, or None"},
    {NULL}
};

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.pool._native.Entry",
    .tp_basicsize = sizeof(EntryObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A prefix-cache entry: its namespace, key, offset, state, pins and LRU links.",
    .tp_new = Entry_new,
    .tp_init = (initproc)Entry_init,
    .tp_dealloc = (destructor)Entry_dealloc,
    .tp_repr = (reprfunc)Entry_repr,
    .tp_getset = Entry_getset,
    .tp_members = Entry_members,
};

/* ---- KeyMap --------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    EntryObject **slots;   /* NULL: empty */
    size_t mask;           /* capacity - 1; capacity a power of two */
    Py_ssize_t used;
    size_t cursor;         /* popitem looks down from here */
} KeyMapObject;

static PyTypeObject KeyMapType;
#define MIN_CAP 8

static inline size_t find(KeyMapObject *m, const uint64_t k[2]) {
    /* the slot holding k, or the empty slot its probe run ends at */
    size_t i = (size_t)hash_key(k) & m->mask;
    for (;;) {
        EntryObject *e = m->slots[i];
        if (e == NULL || (e->key[0] == k[0] && e->key[1] == k[1]))
            return i;
        i = (i + 1) & m->mask;
    }
}

static int resize(KeyMapObject *m, size_t cap) {
    EntryObject **old = m->slots, **slots = PyMem_Calloc(cap, sizeof(EntryObject *));
    size_t oldcap = m->mask + 1;
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    m->slots = slots;
    m->mask = cap - 1;
    for (size_t j = 0; j < oldcap; j++) {
        EntryObject *e = old[j];
        /* the entries lie scattered in memory: ask for one 16 slots ahead while this one is
           hashed: the doubling at 786k entries took 118 ms without it, 32 ms with it (a
           dict, which keeps each key's hash in its table, 56 ms) */
        if (j + 16 < oldcap && old[j + 16] != NULL)
            __builtin_prefetch(old[j + 16]->key);
        if (e != NULL) {
            size_t i = (size_t)hash_key(e->key) & m->mask;
            while (slots[i] != NULL)
                i = (i + 1) & m->mask;
            slots[i] = e;
        }
    }
    PyMem_Free(old);
    m->cursor = m->mask;
    return 0;
}

static void remove_at(KeyMapObject *m, size_t i) {
    /* empty slot i and shift back the run after it; the caller owns the removed reference */
    size_t j = i, mask = m->mask;
    for (;;) {
        j = (j + 1) & mask;
        EntryObject *e = m->slots[j];
        if (e == NULL)
            break;
        size_t home = (size_t)hash_key(e->key) & mask;
        /* e stays if its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            m->slots[i] = e;
            i = j;
        }
    }
    m->slots[i] = NULL;
    m->used--;
}

static PyObject *KeyMap_new(PyTypeObject *t, PyObject *args, PyObject *kw) {
    KeyMapObject *m = (KeyMapObject *)t->tp_alloc(t, 0);
    if (m == NULL)
        return NULL;
    m->slots = PyMem_Calloc(MIN_CAP, sizeof(EntryObject *));
    if (m->slots == NULL) {
        Py_DECREF(m);
        return PyErr_NoMemory();
    }
    m->mask = MIN_CAP - 1;
    m->cursor = m->mask;
    return (PyObject *)m;
}

static void drop_slots(EntryObject **slots, size_t cap) {
    /* the references go after the table is out of the map: a dealloc they run sees a consistent map */
    if (slots != NULL) {
        for (size_t i = 0; i < cap; i++)
            Py_XDECREF(slots[i]);
        PyMem_Free(slots);
    }
}

static int clear_all(KeyMapObject *m) {
    EntryObject **slots = m->slots, **fresh = PyMem_Calloc(MIN_CAP, sizeof(EntryObject *));
    size_t cap = m->mask + 1;
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    m->slots = fresh;
    m->mask = MIN_CAP - 1;
    m->used = 0;
    m->cursor = m->mask;
    drop_slots(slots, cap);
    return 0;
}

static void KeyMap_dealloc(KeyMapObject *m) {
    EntryObject **slots = m->slots;
    m->slots = NULL;
    m->used = 0;
    drop_slots(slots, m->mask + 1);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

/* The entry of key (borrowed), or NULL: absent (no error) or an error set. */
static EntryObject *lookup(KeyMapObject *m, PyObject *key) {
    uint64_t k[2];
    int r = read_key(key, k);
    if (r <= 0)
        return NULL;
    return m->slots[find(m, k)];
}

static int set_item(KeyMapObject *m, PyObject *key, PyObject *value) {
    uint64_t k[2];
    if (need_key(key, k) < 0)
        return -1;
    if (Py_TYPE(value) != &EntryType) {
        PyErr_Format(PyExc_TypeError, "a KeyMap holds entries, not %.100s", Py_TYPE(value)->tp_name);
        return -1;
    }
    EntryObject *e = (EntryObject *)value;
    if (e->key[0] != k[0] || e->key[1] != k[1]) {
        PyErr_SetString(PyExc_ValueError, "an entry goes under its own key");
        return -1;
    }
    size_t i = find(m, k);
    if (m->slots[i] != NULL) {
        Py_INCREF(e);
        Py_SETREF(m->slots[i], e);
        return 0;
    }
    if ((size_t)(m->used + 1) * 4 > (m->mask + 1) * 3) {
        if (resize(m, (m->mask + 1) * 2) < 0)
            return -1;
        i = find(m, k);
    }
    Py_INCREF(e);
    m->slots[i] = e;
    m->used++;
    if (i > m->cursor)
        m->cursor = i;
    return 0;
}

/* Take key's entry out: a new reference, or NULL (absent: no error; or an error set). */
static EntryObject *take(KeyMapObject *m, PyObject *key) {
    uint64_t k[2];
    int r = read_key(key, k);
    if (r <= 0)
        return NULL;
    size_t i = find(m, k);
    EntryObject *e = m->slots[i];
    if (e != NULL)
        remove_at(m, i);
    return e;
}

static Py_ssize_t KeyMap_len(KeyMapObject *m) { return m->used; }

static PyObject *KeyMap_getitem(KeyMapObject *m, PyObject *key) {
    EntryObject *e = lookup(m, key);
    if (e == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    Py_INCREF(e);
    return (PyObject *)e;
}

static int KeyMap_setitem(KeyMapObject *m, PyObject *key, PyObject *value) {
    if (value != NULL)
        return set_item(m, key, value);
    EntryObject *e = take(m, key);
    if (e == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    Py_DECREF(e);
    return 0;
}

static int KeyMap_contains(KeyMapObject *m, PyObject *key) {
    EntryObject *e = lookup(m, key);
    return e != NULL ? 1 : (PyErr_Occurred() ? -1 : 0);
}

static PyObject *KeyMap_get(KeyMapObject *m, PyObject *const *args, Py_ssize_t n) {
    if (n < 1 || n > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    EntryObject *e = lookup(m, args[0]);
    if (e == NULL) {
        if (PyErr_Occurred())
            return NULL;
        PyObject *d = n == 2 ? args[1] : Py_None;
        Py_INCREF(d);
        return d;
    }
    Py_INCREF(e);
    return (PyObject *)e;
}

static PyObject *KeyMap_pop(KeyMapObject *m, PyObject *const *args, Py_ssize_t n) {
    if (n < 1 || n > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    EntryObject *e = take(m, args[0]);
    if (e != NULL)
        return (PyObject *)e;
    if (PyErr_Occurred())
        return NULL;
    if (n == 2) {
        Py_INCREF(args[1]);
        return args[1];
    }
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *KeyMap_popitem(KeyMapObject *m, PyObject *unused) {
    if (m->used == 0) {
        PyErr_SetString(PyExc_KeyError, "popitem(): the map is empty");
        return NULL;
    }
    size_t i = m->cursor & m->mask;
    while (m->slots[i] == NULL)
        i = (i - 1) & m->mask;
    EntryObject *e = m->slots[i];
    PyObject *key = Entry_get_key(e, NULL);
    if (key == NULL)
        return NULL;
    remove_at(m, i);
    m->cursor = i;
    PyObject *out = PyTuple_Pack(2, key, (PyObject *)e);
    Py_DECREF(key);
    Py_DECREF(e);
    return out;
}

static PyObject *many(KeyMapObject *m, PyObject *keys, int strict) {
    PyObject *seq = PySequence_Fast(keys, "keys must be iterable");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t j = 0; j < n; j++) {
        EntryObject *e = lookup(m, items[j]);
        if (e == NULL) {
            if (PyErr_Occurred())
                goto fail;
            if (strict) {
                PyErr_SetObject(PyExc_KeyError, items[j]);
                goto fail;
            }
            Py_INCREF(Py_None);
            PyList_SET_ITEM(out, j, Py_None);
        } else {
            Py_INCREF(e);
            PyList_SET_ITEM(out, j, (PyObject *)e);
        }
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *KeyMap_get_many(KeyMapObject *m, PyObject *keys) { return many(m, keys, 0); }
static PyObject *KeyMap_fetch(KeyMapObject *m, PyObject *keys) { return many(m, keys, 1); }

/* 0: keys, 1: values, 2: items; a list (a snapshot: the map may change while it is walked) */
static PyObject *listing(KeyMapObject *m, int what) {
    PyObject *out = PyList_New(m->used);
    if (out == NULL)
        return NULL;
    Py_ssize_t j = 0;
    for (size_t i = 0; i <= m->mask && j < m->used; i++) {
        EntryObject *e = m->slots[i];
        if (e == NULL)
            continue;
        PyObject *x;
        if (what == 1) {
            Py_INCREF(e);
            x = (PyObject *)e;
        } else {
            PyObject *key = Entry_get_key(e, NULL);
            if (key == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            x = what == 0 ? key : PyTuple_Pack(2, key, (PyObject *)e);
            if (what == 2)
                Py_DECREF(key);
            if (x == NULL) {
                Py_DECREF(out);
                return NULL;
            }
        }
        PyList_SET_ITEM(out, j++, x);
    }
    return out;
}

static PyObject *KeyMap_keys(KeyMapObject *m, PyObject *u) { return listing(m, 0); }
static PyObject *KeyMap_values(KeyMapObject *m, PyObject *u) { return listing(m, 1); }
static PyObject *KeyMap_items(KeyMapObject *m, PyObject *u) { return listing(m, 2); }

static PyObject *KeyMap_iter(KeyMapObject *m) {
    PyObject *keys = listing(m, 0);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *KeyMap_update(KeyMapObject *m, PyObject *pairs) {
    PyObject *src = pairs, *it, *pair;
    int mapping = PyObject_HasAttrString(pairs, "items");
    if (mapping && (src = PyObject_CallMethod(pairs, "items", NULL)) == NULL)
        return NULL;
    it = PyObject_GetIter(src);
    if (mapping)
        Py_DECREF(src);
    if (it == NULL)
        return NULL;
    while ((pair = PyIter_Next(it)) != NULL) {
        PyObject *k, *v;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "update() takes (key, entry) pairs");
            Py_DECREF(pair);
            Py_DECREF(it);
            return NULL;
        }
        k = PyTuple_GET_ITEM(pair, 0);
        v = PyTuple_GET_ITEM(pair, 1);
        int r = set_item(m, k, v);
        Py_DECREF(pair);
        if (r < 0) {
            Py_DECREF(it);
            return NULL;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static int KeyMap_init(KeyMapObject *m, PyObject *args, PyObject *kw) {
    PyObject *pairs = NULL;
    if (kw != NULL && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "KeyMap(pairs=()) takes no keywords");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "|O", &pairs))
        return -1;
    if (pairs != NULL) {
        PyObject *r = KeyMap_update(m, pairs);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    return 0;
}

static PyObject *KeyMap_clear(KeyMapObject *m, PyObject *u) {
    if (clear_all(m) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *KeyMap_table_bytes(KeyMapObject *m, PyObject *u) {
    return PyLong_FromSize_t((m->mask + 1) * sizeof(EntryObject *));
}

static PyObject *KeyMap_repr(KeyMapObject *m) {
    return PyUnicode_FromFormat("<KeyMap of %zd entries>", m->used);
}

static PyMethodDef KeyMap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))KeyMap_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))KeyMap_pop, METH_FASTCALL, "pop(key[, default])"},
    {"popitem", (PyCFunction)KeyMap_popitem, METH_NOARGS, "(key, entry) taken out; KeyError when empty"},
    {"get_many", (PyCFunction)KeyMap_get_many, METH_O, "[get(k) for k in keys]"},
    {"fetch", (PyCFunction)KeyMap_fetch, METH_O, "[m[k] for k in keys]: KeyError at the first absent"},
    {"keys", (PyCFunction)KeyMap_keys, METH_NOARGS, "a list of the keys"},
    {"values", (PyCFunction)KeyMap_values, METH_NOARGS, "a list of the entries"},
    {"items", (PyCFunction)KeyMap_items, METH_NOARGS, "a list of (key, entry)"},
    {"update", (PyCFunction)KeyMap_update, METH_O, "update(mapping or (key, entry) pairs)"},
    {"clear", (PyCFunction)KeyMap_clear, METH_NOARGS, "drop every entry"},
    {"table_bytes", (PyCFunction)KeyMap_table_bytes, METH_NOARGS, "bytes its slot table takes"},
    {NULL}
};

static PyMappingMethods KeyMap_mapping = {
    .mp_length = (lenfunc)KeyMap_len,
    .mp_subscript = (binaryfunc)KeyMap_getitem,
    .mp_ass_subscript = (objobjargproc)KeyMap_setitem,
};

static PySequenceMethods KeyMap_sequence = {
    .sq_contains = (objobjproc)KeyMap_contains,
};

static PyTypeObject KeyMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.pool._native.KeyMap",
    .tp_basicsize = sizeof(KeyMapObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "block key -> Entry, keyed by the entry's own key: the dict API the index uses.",
    .tp_new = KeyMap_new,
    .tp_init = (initproc)KeyMap_init,
    .tp_dealloc = (destructor)KeyMap_dealloc,
    .tp_repr = (reprfunc)KeyMap_repr,
    .tp_as_mapping = &KeyMap_mapping,
    .tp_as_sequence = &KeyMap_sequence,
    .tp_iter = (getiterfunc)KeyMap_iter,
    .tp_methods = KeyMap_methods,
};

/* ---- module ---------------------------------------------------------------- */
static PyObject *seed(PyObject *mod, PyObject *arg) {
    /* the hash key; before any map holds an entry (a map keeps its slots where the old key put them) */
    if (!PyBytes_Check(arg) || PyBytes_GET_SIZE(arg) != 16) {
        PyErr_SetString(PyExc_ValueError, "seed() takes 16 bytes");
        return NULL;
    }
    memcpy(&sip_k0, PyBytes_AS_STRING(arg), 8);
    memcpy(&sip_k1, PyBytes_AS_STRING(arg) + 8, 8);
    Py_RETURN_NONE;
}

static inline int pin_step(EntryObject *e, long delta) {
    long long pins = (long long)((e->word >> 1) & PIN_MAX) + delta;
    if (pins < 0 || pins > (long long)PIN_MAX)
        return -1;
    put_pins(e, (uint64_t)pins);
    return 0;
}

static PyObject *add_pins(PyObject *mod, PyObject *const *args, Py_ssize_t n) {
    /* add_pins(entries, delta): every entry (None skipped) pinned delta more; -> None, or the index
     * of the first whose pins would leave [0, PIN_MAX], and then none is changed. An entry may be
     * named many times (a load naming one block twice pins it twice): each step is applied in turn
     * and, at the first out of range, the ones before it are undone. */
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "add_pins(entries, delta)");
        return NULL;
    }
    long delta = PyLong_AsLong(args[1]);
    if (delta == -1 && PyErr_Occurred())
        return NULL;
    if (delta < -(long)PIN_MAX || delta > (long)PIN_MAX) {
        PyErr_SetString(PyExc_OverflowError, "add_pins: delta out of range");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "entries must be iterable");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t j = 0; j < len; j++) {
        if (items[j] != Py_None && Py_TYPE(items[j]) != &EntryType) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_TypeError, "add_pins takes entries, not %.100s", Py_TYPE(items[j])->tp_name);
            return NULL;
        }
    }
    for (Py_ssize_t j = 0; j < len; j++) {
        if (items[j] == Py_None || pin_step((EntryObject *)items[j], delta) == 0)
            continue;
        for (Py_ssize_t u = j - 1; u >= 0; u--)  /* undo: each of these took the step, so it goes back */
            if (items[u] != Py_None)
                pin_step((EntryObject *)items[u], -delta);
        Py_DECREF(seq);
        return PyLong_FromSsize_t(j);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"add_pins", (PyCFunction)(void (*)(void))add_pins, METH_FASTCALL,
     "add_pins(entries, delta) -> None, or the index of the first entry it would take out of range"},
    {"seed", seed, METH_O, "seed(16 random bytes): the key the maps hash block keys with"},
    {NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier.pool._native",
    "Compact prefix-index entries and their key -> entry table (kvtier/pool/entry.py).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&EntryType) < 0 || PyType_Ready(&KeyMapType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    WRITING_S = PyUnicode_InternFromString("writing");
    READY_S = PyUnicode_InternFromString("ready");
    if (WRITING_S == NULL || READY_S == NULL)
        return NULL;
    Py_INCREF(&EntryType);
    Py_INCREF(&KeyMapType);
    Py_INCREF(WRITING_S);
    Py_INCREF(READY_S);
    if (PyModule_AddObject(m, "Entry", (PyObject *)&EntryType) < 0 ||
        PyModule_AddObject(m, "KeyMap", (PyObject *)&KeyMapType) < 0 ||
        PyModule_AddObject(m, "WRITING", WRITING_S) < 0 ||
        PyModule_AddObject(m, "READY", READY_S) < 0 ||
        PyModule_AddIntConstant(m, "ENTRY_BYTES", (long)sizeof(EntryObject)) < 0 ||
        PyModule_AddIntConstant(m, "PIN_MAX", (long)PIN_MAX) < 0 ||
        PyModule_AddObject(m, "OFFSET_MAX", PyLong_FromUnsignedLongLong(OFF_MAX)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
