// A SentencePiece BPE vocabulary (Gemma's) read from a GGUF file's tokens, encoding and decoding
// exactly as the `tokenizers` tokenizer that gguf_tokenizer.gemma_sentencepiece builds from the
// same tokens, in a few MB where that one holds about 100 (its vocabulary twice as Rust strings,
// and 515k merges in a hash map) and parses a 33 MB JSON for a second at every start.
//
// Merges are not stored: a pair of tokens merges when their two strings joined are a token, and
// its rank, as gemma_sentencepiece orders them, is the joined token's id, then the left part
// longest first. The rest is `tokenizers`' BPE as it runs: added tokens split out of the raw text
// leftmost-longest, " " -> U+2581 in what is between, characters not in the vocabulary as their
// bytes' <0xXX> tokens, then the pair of least rank merged first (the leftmost of equals), a
// queued pair dropped where its symbols changed since.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { ADDED = 1, SPECIAL = 2, SHADOWED = 4 };  // flags per token id
enum { CONTROL = 3, USER_DEFINED = 4 };         // GGUF token types

typedef struct {
    int64_t n;
    uint32_t *offset;  // n + 1: token i's string is blob[offset[i], offset[i + 1])
    char *blob;
    uint32_t *cps;     // code points per token: the rank's tie-break
    uint8_t *flags;
    uint32_t *table;   // open addressing, id + 1 (0: empty); a string's last id wins
    uint64_t mask;
    int32_t byte_ids[256];
    int32_t unk_id, bos_id, eos_id;
    int add_bos, add_eos;
    int64_t added_max;      // the longest added token, in bytes
    uint8_t added_first[256];  // which bytes an added token starts with
} Vocab;

static uint64_t hash_bytes(const char *s, int64_t len) {
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i < len; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static int32_t lookup(const Vocab *v, const char *s, int64_t len) {
    for (uint64_t at = hash_bytes(s, len) & v->mask;; at = (at + 1) & v->mask) {
        uint32_t slot = v->table[at];
        if (!slot) return -1;
        uint32_t id = slot - 1, start = v->offset[id];
        if (v->offset[id + 1] - start == (uint64_t)len && !memcmp(v->blob + start, s, len)) return (int32_t)id;
    }
}

// A left part joined to a right one, looked up: `scratch` holds at least both.
static int32_t lookup_pair(const Vocab *v, int32_t a, int32_t b, char *scratch) {
    uint32_t la = v->offset[a + 1] - v->offset[a], lb = v->offset[b + 1] - v->offset[b];
    memcpy(scratch, v->blob + v->offset[a], la);
    memcpy(scratch + la, v->blob + v->offset[b], lb);
    return lookup(v, scratch, la + lb);
}

static int64_t utf8_length(uint8_t lead) {
    return lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
}

static uint32_t utf8_decode(const uint8_t *s, int64_t len) {
    if (len == 1) return s[0];
    uint32_t c = s[0] & (0xFF >> (len + 1));
    for (int64_t i = 1; i < len; i++) c = (c << 6) | (s[i] & 0x3F);
    return c;
}

// Python's str.isspace(): what str.strip() takes off.
static int is_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// A token all whitespace with a space in it is stored with real spaces, and matches text whose
// spaces became U+2581: it is that many U+2581s (as gemma_sentencepiece and the converter have it).
static int64_t spaces_token(const uint8_t *s, int64_t len) {
    int64_t count = 0, has_space = 0;
    for (int64_t i = 0; i < len;) {
        int64_t k = utf8_length(s[i]);
        if (i + k > len) return 0;
        uint32_t c = utf8_decode(s + i, k);
        if (!is_space(c)) return 0;
        has_space |= c == ' ';
        count++;
        i += k;
    }
    return has_space ? count : 0;
}

static uint32_t code_points(const char *s, int64_t len) {
    uint32_t count = 0;
    for (int64_t i = 0; i < len; i++) count += ((uint8_t)s[i] & 0xC0) != 0x80;
    return count;
}

void spbpe_free(Vocab *v) {
    if (!v) return;
    free(v->offset); free(v->blob); free(v->cps); free(v->flags); free(v->table);
    free(v);
}

// `strings`: a GGUF array of n strings (each a u64 length and its bytes), `avail` bytes of them
// readable; `types`: their GGUF token types. NULL for a cut-short array or out of memory.
Vocab *spbpe_new(const uint8_t *strings, int64_t avail, int64_t n, const int32_t *types, int32_t bos_id,
                 int32_t eos_id, int add_bos, int add_eos) {
    Vocab *v = calloc(1, sizeof(Vocab));
    if (!v || n <= 0 || n >= (1ll << 31)) { free(v); return NULL; }
    v->n = n;
    int64_t blob_bytes = 0;
    for (int64_t i = 0, at = 0; i < n; i++) {  // sizes first: a spaces token grows (1 -> 3 bytes a char)
        if (at + 8 > avail) { spbpe_free(v); return NULL; }
        uint64_t len;
        memcpy(&len, strings + at, 8);
        if (len > (uint64_t)(avail - at - 8)) { spbpe_free(v); return NULL; }
        int64_t spaces = spaces_token(strings + at + 8, (int64_t)len);
        blob_bytes += spaces ? 3 * spaces : (int64_t)len;
        at += 8 + (int64_t)len;
    }
    if (blob_bytes >= (1ll << 32)) { spbpe_free(v); return NULL; }
    uint64_t size = 1;
    while (size < 2 * (uint64_t)n) size <<= 1;
    v->mask = size - 1;
    v->offset = malloc((n + 1) * sizeof(uint32_t));
    v->blob = malloc(blob_bytes + 1);
    v->cps = malloc(n * sizeof(uint32_t));
    v->flags = calloc(n, 1);
    v->table = calloc(size, sizeof(uint32_t));
    if (!v->offset || !v->blob || !v->cps || !v->flags || !v->table) { spbpe_free(v); return NULL; }
    uint32_t used = 0;
    for (int64_t i = 0, at = 0; i < n; i++) {
        uint64_t len;
        memcpy(&len, strings + at, 8);
        const uint8_t *s = strings + at + 8;
        int64_t spaces = spaces_token(s, (int64_t)len);
        v->offset[i] = used;
        if (spaces) {
            for (int64_t k = 0; k < spaces; k++, used += 3) memcpy(v->blob + used, "\xE2\x96\x81", 3);
        } else {
            memcpy(v->blob + used, s, len);
            used += (uint32_t)len;
        }
        at += 8 + (int64_t)len;
    }
    v->offset[n] = used;
    for (int64_t i = 0; i < n; i++) {
        const char *s = v->blob + v->offset[i];
        int64_t len = v->offset[i + 1] - v->offset[i];
        v->cps[i] = code_points(s, len);
        uint64_t at = hash_bytes(s, len) & v->mask;
        for (;; at = (at + 1) & v->mask) {
            uint32_t slot = v->table[at];
            if (!slot) break;
            uint32_t id = slot - 1;
            if (v->offset[id + 1] - v->offset[id] == (uint64_t)len && !memcmp(v->blob + v->offset[id], s, len)) {
                v->flags[id] |= SHADOWED;  // the same string again: it has the later id
                break;
            }
        }
        v->table[at] = (uint32_t)i + 1;
    }
    // Added tokens are their strings as the file has them: control ones special, user-defined
    // ones where that string is a token (one with spaces is not: its token has U+2581s).
    for (int64_t i = 0, at = 0; i < n; i++) {
        uint64_t len;
        memcpy(&len, strings + at, 8);
        if (types && (types[i] == CONTROL || types[i] == USER_DEFINED)) {
            int32_t id = lookup(v, (const char *)strings + at + 8, (int64_t)len);
            if (id >= 0 && len > 0) {
                v->flags[id] |= ADDED | (types[i] == CONTROL ? SPECIAL : 0);
                v->added_first[strings[at + 8]] = 1;
                if ((int64_t)len > v->added_max) v->added_max = (int64_t)len;
            }
        }
        at += 8 + (int64_t)len;
    }
    for (int b = 0; b < 256; b++) {
        char name[7];
        static const char hex[] = "0123456789ABCDEF";
        memcpy(name, "<0x", 3);
        name[3] = hex[b >> 4]; name[4] = hex[b & 15]; name[5] = '>';
        v->byte_ids[b] = lookup(v, name, 6);
    }
    v->unk_id = lookup(v, "<unk>", 5);
    v->bos_id = bos_id;
    v->eos_id = eos_id;
    v->add_bos = add_bos && bos_id >= 0 && bos_id < n;
    v->add_eos = add_eos && eos_id >= 0 && eos_id < n;
    return v;
}

// The tables as they are, for the Python side to read: n flags, n + 1 offsets, the strings.
const uint8_t *spbpe_flags(const Vocab *v) { return v->flags; }
const uint32_t *spbpe_offsets(const Vocab *v) { return v->offset; }
const char *spbpe_strings(const Vocab *v) { return v->blob; }
int32_t spbpe_token_to_id(const Vocab *v, const char *s, int64_t len) { return lookup(v, s, len); }

typedef struct { uint64_t rank; int64_t pos; int32_t id; } Merge;
typedef struct { int32_t id, prev, next; } Symbol;  // a removed symbol has id -1

static int merge_before(const Merge *a, const Merge *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(Merge *heap, int64_t *count, Merge m) {
    int64_t i = (*count)++;
    while (i > 0 && merge_before(&m, &heap[(i - 1) / 2])) { heap[i] = heap[(i - 1) / 2]; i = (i - 1) / 2; }
    heap[i] = m;
}

static Merge heap_pop(Merge *heap, int64_t *count) {
    Merge top = heap[0], last = heap[--*count];
    int64_t i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= *count) break;
        if (child + 1 < *count && merge_before(&heap[child + 1], &heap[child])) child++;
        if (!merge_before(&heap[child], &last)) break;
        heap[i] = heap[child];
        i = child;
    }
    if (*count) heap[i] = last;
    return top;
}

// The pair (left, right) as a queued merge at `pos`, or 0 where the two do not make a token.
static int pair_merge(const Vocab *v, int32_t left, int32_t right, int64_t pos, char *scratch, Merge *out) {
    int32_t joined = lookup_pair(v, left, right, scratch);
    if (joined < 0) return 0;
    out->rank = ((uint64_t)joined << 32) | (0xFFFFFFFFu - v->cps[left]);
    out->pos = pos;
    out->id = joined;
    return 1;
}

// One piece of text between added tokens (spaces already U+2581) into `out`: how many ids;
// -1 when out of memory.
static int64_t encode_word(const Vocab *v, const uint8_t *s, int64_t len, int32_t *out) {
    Symbol *symbols = malloc((len + 1) * sizeof(Symbol));
    Merge *heap = malloc((3 * len + 1) * sizeof(Merge));  // a pair a symbol, and two more a merge
    char *scratch = NULL;
    int64_t count = 0, longest = 0;
    if (!symbols || !heap) { free(symbols); free(heap); return -1; }
    int32_t unk = -1;  // consecutive unknown characters fuse into one <unk>
    for (int64_t i = 0; i < len;) {
        int64_t k = utf8_length(s[i]);
        if (i + k > len) k = len - i;
        int32_t id = lookup(v, (const char *)s + i, k);
        int known = id >= 0;
        if (!known) {
            known = 1;
            for (int64_t b = 0; b < k; b++) known &= v->byte_ids[s[i + b]] >= 0;
            if (known) {
                for (int64_t b = 0; b < k; b++) symbols[count++] = (Symbol){v->byte_ids[s[i + b]], 0, 0};
                i += k;
                continue;
            }
            if (v->unk_id >= 0) unk = v->unk_id;
            i += k;
            continue;
        }
        if (unk >= 0) { symbols[count++] = (Symbol){unk, 0, 0}; unk = -1; }
        symbols[count++] = (Symbol){id, 0, 0};
        i += k;
    }
    if (unk >= 0) symbols[count++] = (Symbol){unk, 0, 0};
    for (int64_t i = 0; i < count; i++) {
        symbols[i].prev = (int32_t)i - 1;
        symbols[i].next = i + 1 < count ? (int32_t)i + 1 : -1;
        int64_t l = v->offset[symbols[i].id + 1] - v->offset[symbols[i].id];
        longest += l;  // a joined pair is never longer than the word
    }
    scratch = malloc(longest + 1);
    if (!scratch) { free(symbols); free(heap); return -1; }
    int64_t queued = 0;
    Merge m;
    for (int64_t i = 0; i + 1 < count; i++)
        if (pair_merge(v, symbols[i].id, symbols[i + 1].id, i, scratch, &m)) heap_push(heap, &queued, m);
    while (queued) {
        Merge top = heap_pop(heap, &queued);
        Symbol *at = &symbols[top.pos];
        if (at->id < 0 || at->next < 0) continue;
        Symbol *right = &symbols[at->next];
        if (lookup_pair(v, at->id, right->id, scratch) != top.id) continue;  // changed since it was queued
        at->id = top.id;
        int32_t after = right->next;
        right->id = -1;
        at->next = after;
        if (after >= 0) symbols[after].prev = (int32_t)top.pos;
        if (at->prev >= 0 && pair_merge(v, symbols[at->prev].id, at->id, at->prev, scratch, &m)) heap_push(heap, &queued, m);
        if (after >= 0 && pair_merge(v, at->id, symbols[after].id, top.pos, scratch, &m)) heap_push(heap, &queued, m);
    }
    int64_t written = 0;
    for (int64_t i = 0; i < count; i++)
        if (symbols[i].id >= 0) out[written++] = symbols[i].id;
    free(symbols); free(heap); free(scratch);
    return written;
}

// The longest added token at text[0..), its id, or -1.
static int32_t added_at(const Vocab *v, const char *text, int64_t left, int64_t *matched) {
    if (!v->added_first[(uint8_t)text[0]]) return -1;
    for (int64_t len = left < v->added_max ? left : v->added_max; len > 0; len--) {
        int32_t id = lookup(v, text, len);
        if (id >= 0 && (v->flags[id] & ADDED)) { *matched = len; return id; }
    }
    return -1;
}

// The text between added tokens, spaces as U+2581, encoded onto out: ids written, -1 out of memory.
static int64_t encode_plain(const Vocab *v, const char *text, int64_t len, int32_t *out) {
    if (!len) return 0;
    int64_t spaces = 0;
    for (int64_t i = 0; i < len; i++) spaces += text[i] == ' ';
    uint8_t *normal = malloc(len + 2 * spaces + 1);
    if (!normal) return -1;
    int64_t at = 0;
    for (int64_t i = 0; i < len; i++) {
        if (text[i] == ' ') { memcpy(normal + at, "\xE2\x96\x81", 3); at += 3; }
        else normal[at++] = (uint8_t)text[i];
    }
    int64_t written = encode_word(v, normal, at, out);
    free(normal);
    return written;
}

// `text` (UTF-8, len bytes) to ids in `out` (room for len + 2 always suffices): how many; -1 out
// of memory. With `special`, BOS and EOS where the vocabulary adds them.
int64_t spbpe_encode(const Vocab *v, const char *text, int64_t len, int32_t *out, int special) {
    int64_t written = 0, start = 0;
    if (special && v->add_bos) out[written++] = v->bos_id;
    for (int64_t i = 0; i < len;) {
        int64_t matched = 0;
        int32_t id = added_at(v, text + i, len - i, &matched);
        if (id < 0) { i++; continue; }
        int64_t n = encode_plain(v, text + start, i - start, out + written);
        if (n < 0) return -1;
        written += n;
        out[written++] = id;
        i += matched;
        start = i;
    }
    int64_t n = encode_plain(v, text + start, len - start, out + written);
    if (n < 0) return -1;
    written += n;
    if (special && v->add_eos) out[written++] = v->eos_id;
    return written;
}

static int hex_digit(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

// A byte-fallback token's byte ("<0xXX>"), or -1.
static int fallback_byte(const char *s, int64_t len) {
    if (len != 6 || memcmp(s, "<0x", 3) || s[5] != '>') return -1;
    int hi = hex_digit(s[3]), lo = hex_digit(s[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

static int valid_utf8(const uint8_t *s, int64_t len) {
    for (int64_t i = 0; i < len;) {
        uint8_t c = s[i];
        int64_t k = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
        if (!k || i + k > len) return 0;
        for (int64_t j = 1; j < k; j++) if ((s[i + j] & 0xC0) != 0x80) return 0;
        uint32_t cp = utf8_decode(s + i, k);
        if ((k == 2 && cp < 0x80) || (k == 3 && cp < 0x800) || (k == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
            (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
        i += k;
    }
    return 1;
}

// A run of fallback bytes as text: itself where it is UTF-8, else U+FFFD a byte.
static int64_t flush_bytes(const uint8_t *run, int64_t n, char *out, int64_t at, int64_t cap) {
    if (valid_utf8(run, n)) {
        if (at + n <= cap) memcpy(out + at, run, n);
        return at + n;
    }
    for (int64_t i = 0; i < n; i++, at += 3) if (at + 3 <= cap) memcpy(out + at, "\xEF\xBF\xBD", 3);
    return at;
}

// ids to UTF-8 text in `out`: its length, written only where it fits `cap`. Ids out of range,
// and shadowed ones (no string maps to them), give nothing; with `skip_special`, special tokens
// neither (nor do they end a run of fallback bytes).
int64_t spbpe_decode(const Vocab *v, const int64_t *ids, int64_t n, int skip_special, char *out, int64_t cap) {
    uint8_t *run = malloc(n + 1);
    if (!run) return -1;
    int64_t at = 0, bytes = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t id = ids[i];
        if (id < 0 || id >= v->n || (v->flags[id] & SHADOWED) || (skip_special && (v->flags[id] & SPECIAL))) continue;
        const char *s = v->blob + v->offset[id];
        int64_t len = v->offset[id + 1] - v->offset[id];
        int b = fallback_byte(s, len);
        if (b >= 0) { run[bytes++] = (uint8_t)b; continue; }
        if (bytes) { at = flush_bytes(run, bytes, out, at, cap); bytes = 0; }
        for (int64_t j = 0; j < len;) {
            if (j + 3 <= len && !memcmp(s + j, "\xE2\x96\x81", 3)) {
                if (at < cap) out[at] = ' ';
                at++;
                j += 3;
            } else {
                if (at < cap) out[at] = s[j];
                at++;
                j++;
            }
        }
    }
    if (bytes) at = flush_bytes(run, bytes, out, at, cap);
    free(run);
    return at;
}
