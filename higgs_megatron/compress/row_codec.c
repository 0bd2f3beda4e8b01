/* The sign exchange's codec on the CPU, fused: one pass per operation over a bucket's rows.
 *
 * The reference is compress/agreed.py (pack_rows, unpack_rows for "sign"); these loops compute
 * the same values in the same order, so the bytes, sums and residuals are equal bit for bit
 * (tests/compress/test_row_codec.py): a span's sum of magnitudes by halving (slots i and
 * i + h added, h from half the span's power of two down to 1, zeros past the span), the
 * owner's sum of rows in row order, and no fused multiply-add (built with -ffp-contract=off,
 * never -ffast-math).
 *
 * A row of the wire: an fp32 scale per span, then a bit per slot (slot j in byte j / 8, bit
 * j % 8, set where the value is 0 or more), padded to 4 bytes. Row r's real slots are its
 * first used[r]; the rest are padding, which carries no magnitude and decodes to 0.
 *
 * Where the rows are a bucket's coordinates, they are given as runs (int64 triples: a slot of
 * the flattened rows, the coordinate it holds, a length), sorted by slot, covering each row's
 * real slots exactly; pad[r] is the coordinate a padding slot of row r points to (-1: none),
 * to which the reference's index_add_ adds 0 (which makes a -0 +0, so it is done here too).
 */
#include <stdint.h>
#include <string.h>

#define MAX_SPAN 4096

typedef struct {
    int64_t slot, coord, length;
} run_t;

static float halving_sum(float *t, int64_t pow2) {
    for (int64_t h = pow2 >> 1; h >= 1; h >>= 1)
        for (int64_t i = 0; i < h; i++) t[i] = t[i] + t[i + h];
    return t[0];
}

static int64_t pow2_at_least(int64_t n) {
    int64_t p = 1;
    while (p < n) p <<= 1;
    return p;
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The n values of the span at slot a of the flattened rows, from src at the runs' coordinates
 * (the padding 0), or src itself where runs is NULL; *k is the first run not yet passed (the
 * spans come in order). */
static void gather_span(const float *src, const run_t *runs, int64_t n_runs, int64_t *k, int64_t a, int64_t n,
                        float *values) {
    if (!runs) {
        memcpy(values, src + a, (size_t)n * sizeof(float));
        return;
    }
    memset(values, 0, (size_t)n * sizeof(float));
    while (*k < n_runs && runs[*k].slot + runs[*k].length <= a) (*k)++;
    for (int64_t i = *k; i < n_runs && runs[i].slot < a + n; i++) {
        const int64_t lo = max64(a, runs[i].slot), hi = min64(a + n, runs[i].slot + runs[i].length);
        memcpy(values + (lo - a), src + runs[i].coord + (lo - runs[i].slot), (size_t)(hi - lo) * sizeof(float));
    }
}

enum { WRITE, ADD, ADD_TO_ZERO };

/* The span's n values put at the runs' coordinates of out (or at slot a where runs is NULL):
 * written, added to what out holds, or added to 0 (as if out were zeroed first). */
static void put_span(const run_t *runs, int64_t n_runs, int64_t *k, int64_t a, int64_t n, const float *values,
                     int how, float *out) {
    if (!runs) {
        memcpy(out + a, values, (size_t)n * sizeof(float));
        return;
    }
    while (*k < n_runs && runs[*k].slot + runs[*k].length <= a) (*k)++;
    for (int64_t i = *k; i < n_runs && runs[i].slot < a + n; i++) {
        const int64_t lo = max64(a, runs[i].slot), hi = min64(a + n, runs[i].slot + runs[i].length);
        float *o = out + runs[i].coord + (lo - runs[i].slot);
        const float *v = values + (lo - a);
        if (how == WRITE)
            memcpy(o, v, (size_t)(hi - lo) * sizeof(float));
        else if (how == ADD)
            for (int64_t j = 0; j < hi - lo; j++) o[j] = o[j] + v[j];
        else
            for (int64_t j = 0; j < hi - lo; j++) o[j] = 0.0f + v[j];
    }
}

/* SIGN_FLIPS[byte][k]: the sign bit where bit k of byte is clear (that slot's value is -scale),
 * so a slot decodes as the scale's bits XOR this: 8 slots from a byte without a branch. */
static uint32_t SIGN_FLIPS[256][8];

__attribute__((constructor)) static void fill_sign_flips(void) {
    for (int byte = 0; byte < 256; byte++)
        for (int k = 0; k < 8; k++) SIGN_FLIPS[byte][k] = ((byte >> k) & 1) ? 0u : 0x80000000u;
}

/* A span's n values into out: the first `real` the scale with each bit's sign, the rest 0
 * (the padding); bits start at the span's first slot (a span starts on a byte). */
static inline void decode_span(float scale, const uint8_t *bits, int64_t real, int64_t n, float *out) {
    uint32_t scale_bits, word[8];
    memcpy(&scale_bits, &scale, sizeof scale_bits);
    const int64_t whole = real / 8;
    for (int64_t b = 0; b < whole; b++) {
        const uint32_t *flips = SIGN_FLIPS[bits[b]];
        for (int k = 0; k < 8; k++) word[k] = scale_bits ^ flips[k];
        memcpy(out + 8 * b, word, sizeof word);
    }
    for (int64_t j = 8 * whole; j < real; j++) out[j] = ((bits[j >> 3] >> (j & 7)) & 1) ? scale : -scale;
    for (int64_t j = real; j < n; j++) out[j] = 0.0f;
}

/* Rows [rows, width] to the wire [rows, row_bytes]: from src at the runs' coordinates (the
 * padding 0), or, where runs is NULL, src itself as the rows (the padding's own values: their
 * bits, and left whole). left gets each real value minus what is decoded from it, at its
 * coordinate (at every slot where runs is NULL). Returns 0, or -1 where the span is too long. */
int sign_encode(const float *src, const int64_t *runs_, int64_t n_runs, const int64_t *used, int64_t rows,
                int64_t width, int64_t span, int64_t row_bytes, uint8_t *wire, float *left) {
    const run_t *runs = (const run_t *)runs_;
    float values[MAX_SPAN], tree[MAX_SPAN];
    if (span > MAX_SPAN) return -1;
    const int64_t n_scales = (width + span - 1) / span, pow2 = pow2_at_least(span);
    int64_t k_in = 0, k_out = 0;
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *row = wire + r * row_bytes;
        float *scales = (float *)row;
        uint8_t *bits = row + 4 * n_scales;
        memset(bits, 0, (size_t)(row_bytes - 4 * n_scales));
        for (int64_t s = 0; s < n_scales; s++) {
            const int64_t first = s * span, n = min64(span, width - first), a = r * width + first;
            const int64_t real = max64(0, min64(n, used[r] - first));
            gather_span(src, runs, n_runs, &k_in, a, n, values);
            for (int64_t j = 0; j < real; j++) tree[j] = values[j] < 0 ? -values[j] : values[j];
            for (int64_t j = real; j < pow2; j++) tree[j] = 0.0f;
            const float sum = halving_sum(tree, pow2);
            const float scale = real > 0 ? sum / (float)real : 1.0f;
            scales[s] = scale;
            uint8_t *span_bits = bits + first / 8;  /* a span starts on a byte: span % 8 == 0, or one span */
            for (int64_t byte = 0; byte < n / 8; byte++) {
                unsigned packed = 0;
                for (int q = 0; q < 8; q++) packed |= (unsigned)(values[8 * byte + q] >= 0) << q;
                span_bits[byte] = (uint8_t)packed;
            }
            for (int64_t j = n / 8 * 8; j < n; j++) span_bits[j >> 3] |= (uint8_t)((values[j] >= 0) << (j & 7));
            for (int64_t j = 0; j < real; j++) values[j] = values[j] - (values[j] >= 0 ? scale : -scale);
            for (int64_t j = real; j < n; j++) values[j] = values[j] - 0.0f;  /* what is left */
            put_span(runs, n_runs, &k_out, a, n, values, WRITE, left);
        }
    }
    return 0;
}

/* int8 (the dense steps' format): a scale per span, the span's largest magnitude over 127 (of
 * every slot: the padding's values too, as the reference's amax; they are 0 at positions, and
 * the owner's padding sums are 0 as well), each value's code its quotient by the scale rounded
 * half to even and clamped to [-127, 127], decoded as code x scale, the padding's code too. */

/* x rounded to an integer, half to even, for |x| < 2^22 (the codes' quotients): the fp32 sum with
 * 1.5 x 2^23 has no fraction bits left, and IEEE rounds it to nearest even; as torch.round. */
static inline float round_half_even(float x) { return (x + 12582912.0f) - 12582912.0f; }

/* As sign_encode, in int8 (left at every slot a run holds, or at every slot without runs). */
int int8_encode(const float *src, const int64_t *runs_, int64_t n_runs, int64_t rows, int64_t width, int64_t span,
                int64_t row_bytes, uint8_t *wire, float *left) {
    const run_t *runs = (const run_t *)runs_;
    float values[MAX_SPAN], quantized[MAX_SPAN];
    if (span > MAX_SPAN) return -1;
    const int64_t n_scales = (width + span - 1) / span;
    int64_t k_in = 0, k_out = 0;
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *row = wire + r * row_bytes;
        float *scales = (float *)row;
        int8_t *codes = (int8_t *)(row + 4 * n_scales);
        memset(row + 4 * n_scales + width, 0, (size_t)(row_bytes - 4 * n_scales - width));
        for (int64_t s = 0; s < n_scales; s++) {
            const int64_t first = s * span, n = min64(span, width - first), a = r * width + first;
            gather_span(src, runs, n_runs, &k_in, a, n, values);
            /* the largest magnitude as the largest bit pattern with the sign cleared: the same
             * order for non-negative floats (a NaN's is above infinity's, so it wins, as in
             * amax), and an integer maximum the compiler vectorizes */
            int32_t amax_bits = 0;
            for (int64_t j = 0; j < n; j++) {
                int32_t bits;
                memcpy(&bits, values + j, sizeof bits);
                bits &= 0x7fffffff;
                amax_bits = bits > amax_bits ? bits : amax_bits;
            }
            float amax;
            memcpy(&amax, &amax_bits, sizeof amax);
            const float scale = amax > 0 ? amax / 127.0f : 1.0f;
            scales[s] = scale;
            for (int64_t j = 0; j < n; j++) {
                const float code = round_half_even(values[j] / scale);
                quantized[j] = code < -127.0f ? -127.0f : (code > 127.0f ? 127.0f : code);
                values[j] = values[j] - quantized[j] * scale;  /* what is left */
            }
            for (int64_t j = 0; j < n; j++) codes[first + j] = (int8_t)quantized[j];
            put_span(runs, n_runs, &k_out, a, n, values, WRITE, left);
        }
    }
    return 0;
}

enum { SIGN, INT8 };

/* Row r's span s (slots [first, first + n), the first `real` not padding) decoded into out. */
static inline void decode_row_span(int format, const uint8_t *row, int64_t n_scales, int64_t s, int64_t first,
                                   int64_t n, int64_t real, float *out) {
    const float scale = ((const float *)row)[s];
    if (format == SIGN) {
        decode_span(scale, row + 4 * n_scales + first / 8, real, n, out);
    } else {
        const int8_t *codes = (const int8_t *)(row + 4 * n_scales) + first;
        for (int64_t j = 0; j < n; j++) out[j] = (float)codes[j] * scale;
    }
}

/* The owner's sum over the rows [rows, row_bytes] it received, each holding values for the
 * same slots (the first used real), in row order, into sums [width]. */
int rows_decode_sum(int64_t format, const uint8_t *wire, int64_t used, int64_t rows, int64_t width, int64_t span,
                    int64_t row_bytes, float *sums) {
    float values[MAX_SPAN];
    if (span > MAX_SPAN) return -1;
    const int64_t n_scales = (width + span - 1) / span;
    for (int64_t s = 0; s < n_scales; s++) {
        const int64_t first = s * span, n = min64(span, width - first);
        const int64_t real = max64(0, min64(n, used - first));
        float *out = sums + first;
        for (int64_t r = 0; r < rows; r++) {
            decode_row_span((int)format, wire + r * row_bytes, n_scales, s, first, n, real, r == 0 ? out : values);
            if (r > 0)
                for (int64_t j = 0; j < n; j++) out[j] = out[j] + values[j];
        }
    }
    return 0;
}

/* Every row [rows, row_bytes] added into target at the runs' coordinates (overwrite: added to
 * 0, as if those coordinates were zeroed first), and each padding slot's value (0 for signs)
 * added at pad[r] after its row's, as index_add_ adds them. */
int rows_decode_add(int64_t format, const uint8_t *wire, const int64_t *runs_, int64_t n_runs, const int64_t *used,
                    const int64_t *pad, int64_t rows, int64_t width, int64_t span, int64_t row_bytes, int64_t overwrite,
                    float *target) {
    const run_t *runs = (const run_t *)runs_;
    float values[MAX_SPAN];
    if (span > MAX_SPAN) return -1;
    const int64_t n_scales = (width + span - 1) / span;
    int64_t k = 0;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t s = 0; s < n_scales; s++) {
            const int64_t first = s * span, n = min64(span, width - first), a = r * width + first;
            const int64_t real = max64(0, min64(n, used[r] - first));
            decode_row_span((int)format, wire + r * row_bytes, n_scales, s, first, n, real, values);
            put_span(runs, n_runs, &k, a, n, values, overwrite ? ADD_TO_ZERO : ADD, target);
            if (pad[r] >= 0)
                for (int64_t j = real; j < n; j++) target[pad[r]] = target[pad[r]] + values[j];
        }
    }
    return 0;
}
