/* Recurrent layers whose hidden-to-hidden products run in int8 (lucid_fx/kernels/recurrent.py), compiled
 * with native.c (see there): the whole sequence of one layer and direction in one call.
 *
 * Each step quantizes the hidden state's active rows to uint8 on the grid the caller fixed (h_scale,
 * h_zp: an LSTM's, a GRU's and a tanh RNN's state lies in [-1, 1] when it starts there; a relu RNN's grid is each
 * step's own), multiplies them with the packed
 * int8 weight in native_gemm.c's GEMM into float gates (w_scale per output, bias_hh added), adds the
 * input's gates gx (x @ W_ih^T + b_ih, computed for every step at once by the caller) and runs the cell
 * in float32, torch's formulas in torch's order:
 *
 *   LSTM (gates i, f, g, o): c' = f * c + i * g,  h' = o * tanh(c')
 *   GRU  (gates r, z, n):    n = tanh(gx_n + r * gh_n),  h' = (h - n) * z + n
 *   RNN  (one gate):         h' = tanh(gh + gx) or relu(gh + gx)
 *
 * sigmoid and tanh are native_math.h's, within 2e-7 of torch's, so the codes of the next step's state match
 * torch's route (recurrent.py's) except where a value lies that close to a rounding tie.
 *
 * g holds steps, batch, hidden, cell (0 LSTM, 1 GRU, 2 RNN_TANH, 3 RNN_RELU), reverse, gx's and out's row strides (floats), an
 * LSTM's projection size (0: none), then steps + 1 row offsets: step t reads rows rows[t] .. rows[t + 1] - 1 of gx and writes those of out, and
 * its rows are the state's first rows[t + 1] - rows[t] (a packed sequence's batch shrinks with time; the
 * state's other rows keep their values). h and c (NULL but for an LSTM) are (batch, hidden), updated in place;
 * hq (batch x hidden codes) and gh (batch x gates x hidden floats) are scratch. */
#include <math.h>
#include <stdint.h>

#include "native_codes.h" /* REQUANTIZE */
#include "native_math.h"  /* sigmoid_exp, tanh_exp */

void lucid_gemm_float32(const uint8_t *x, const int8_t *packed, float *out, int64_t m, int64_t n, int64_t k,
                        const int32_t *offset, const float *w_scale, const float *bias, float x_scale,
                        float inv_out, int32_t zp, float low, float high, int32_t post);

#define GATES(cell) ((cell) == 0 ? 4 : (cell) == 1 ? 3 : 1) /* cell: 0 LSTM, 1 GRU, 2 RNN_TANH, 3 RNN_RELU */

static void lstm_cell(const float *restrict gh, const float *restrict gx, float *restrict h, float *restrict c,
                      float *restrict out, int64_t hidden) {
    const int64_t H = hidden;
    for (int64_t j = 0; j < H; j++) {
        const float i = sigmoid_exp(gh[j] + gx[j]), f = sigmoid_exp(gh[H + j] + gx[H + j]);
        const float g = tanh_exp(gh[2 * H + j] + gx[2 * H + j]), o = sigmoid_exp(gh[3 * H + j] + gx[3 * H + j]);
        const float cy = f * c[j] + i * g;
        c[j] = cy;
        h[j] = out[j] = o * tanh_exp(cy);
    }
}

static void gru_cell(const float *restrict gh, const float *restrict gx, float *restrict h, float *restrict out,
                     int64_t hidden) {
    const int64_t H = hidden;
    for (int64_t j = 0; j < H; j++) {
        const float r = sigmoid_exp(gh[j] + gx[j]), z = sigmoid_exp(gh[H + j] + gx[H + j]);
        const float n = tanh_exp(gx[2 * H + j] + r * gh[2 * H + j]);
        h[j] = out[j] = (h[j] - n) * z + n;
    }
}

static void rnn_cell(const float *restrict gh, const float *restrict gx, float *restrict h, float *restrict out,
                     int64_t hidden, int relu) {
    for (int64_t j = 0; j < hidden; j++) {
        const float v = gh[j] + gx[j];
        h[j] = out[j] = relu ? (v > 0.0f ? v : 0.0f) : tanh_exp(v);
    }
}

/* The grid of a state whose largest magnitude is `largest`: max(floor, largest) in 127 steps a side
 * (recurrent.state_grid: floor 1; recurrent.tight_grid: a projection's values, floor 0, 1 for all zeros). */
static void grid_of(float largest, float floor, float *scale, float *inv) {
    const double bound = largest > floor ? largest : floor > 0.0f ? floor : 1.0;
    *scale = (float)(bound / 127.0);
    *inv = (float)(127.0 / bound);
}

static float largest_of(const float *h, int64_t n) {
    float largest = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(h[i]);
        largest = a > largest ? a : largest;
    }
    return largest;
}

/* An LSTM's projection (proj_size): h = W_hr (o * tanh(c)), W_hr's packed int8 blocks, its offsets for codes with
 * zero point 128 and per-row scales; hf: scratch for 2 x batch x hidden floats. o * tanh(c) and h are quantized on
 * each step's own tight grid (their largest magnitude in 127 steps a side): h has no fixed bound, and both are
 * often far inside [-1, 1] (W_hr's rows are small), where the grid of [-1, 1] measured 6-14 dB less. */
typedef struct {
    const int8_t *packed;
    const int32_t *offset;
    const float *scale;
    float *hf;
} Projection;

/* One step: the state's active rows (`state` values each: hidden, or an LSTM's projection size) quantized on the
 * grid (h_scale, h_inv; a relu RNN's and a projected LSTM's state has no fixed bound, so its grid is each step's
 * own, from its active rows), their gates by the GEMM, the cell, then the projection where there is one. */
static void step(const float *gx, int64_t gx_stride, const int8_t *packed, const int32_t *offset, const float *w_scale,
                 const float *bias, float *h, float *c, float *out, int64_t out_stride, uint8_t *hq, float *gh,
                 int64_t batch, int64_t hidden, int64_t state, int64_t cell, float h_scale, float h_inv,
                 const Projection *proj) {
    const int64_t gates = GATES(cell) * hidden;
    const float zp = 128.0f;
    if (cell == 3 || proj != NULL) grid_of(largest_of(h, batch * state), proj != NULL ? 0.0f : 1.0f, &h_scale, &h_inv);
    for (int64_t i = 0; i < batch * state; i++) hq[i] = (uint8_t)REQUANTIZE(h[i] * h_inv, -zp, 255.0f - zp, 128);
    lucid_gemm_float32(hq, packed, gh, batch, gates, state, offset, w_scale, bias, h_scale, 0.0f, 0, -INFINITY,
                       INFINITY, 0);
    if (proj != NULL) { /* the cell's o * tanh(c) in hf: its codes on its own tight grid times W_hr are the new state */
        for (int64_t r = 0; r < batch; r++)
            lstm_cell(gh + r * gates, gx + r * gx_stride, proj->hf + r * hidden, c + r * hidden,
                      proj->hf + (batch + r) * hidden, hidden);
        float f_scale, f_inv;
        grid_of(largest_of(proj->hf, batch * hidden), 0.0f, &f_scale, &f_inv);
        for (int64_t i = 0; i < batch * hidden; i++) hq[i] = (uint8_t)REQUANTIZE(proj->hf[i] * f_inv, -zp, 255.0f - zp, 128);
        lucid_gemm_float32(hq, proj->packed, h, batch, state, hidden, proj->offset, proj->scale, NULL, f_scale, 0.0f, 0,
                           -INFINITY, INFINITY, 0);
        for (int64_t r = 0; r < batch; r++)
            for (int64_t j = 0; j < state; j++) out[r * out_stride + j] = h[r * state + j];
        return;
    }
    for (int64_t r = 0; r < batch; r++) {
        const float *x = gx + r * gx_stride;
        float *o = out + r * out_stride;
        if (cell == 0) lstm_cell(gh + r * gates, x, h + r * hidden, c + r * hidden, o, hidden);
        else if (cell == 1) gru_cell(gh + r * gates, x, h + r * hidden, o, hidden);
        else rnn_cell(gh + r * gates, x, h + r * hidden, o, hidden, cell == 3);
    }
}

/* g: steps, batch, hidden, cell, reverse, gx's and out's row strides, the projection's size (0: none), then the
 * row offsets. hr_packed, hr_offset, hr_scale and hf (2 x batch x hidden floats): the projection's, NULL without. */
void lucid_rnn_float32(const float *gx, const int8_t *packed, const int32_t *offset, const float *w_scale,
                       const float *bias, float *h, float *c, float *out, uint8_t *hq, float *gh,
                       const int64_t *g, float h_scale, float h_inv, const int8_t *hr_packed, const int32_t *hr_offset,
                       const float *hr_scale, float *hf) {
    const int64_t steps = g[0], hidden = g[2], cell = g[3], reverse = g[4], gx_stride = g[5], out_stride = g[6];
    const int64_t projected = g[7], *rows = g + 8; /* h_inv: 1 / h_scale rounded as the torch route rounds it */
    const Projection projection = {hr_packed, hr_offset, hr_scale, hf};
    for (int64_t s = 0; s < steps; s++) {
        const int64_t t = reverse ? steps - 1 - s : s, first = rows[t], batch = rows[t + 1] - rows[t];
        step(gx + first * gx_stride, gx_stride, packed, offset, w_scale, bias, h, c, out + first * out_stride,
             out_stride, hq, gh, batch, hidden, projected ? projected : hidden, cell, h_scale, h_inv,
             projected ? &projection : NULL);
    }
}

#define CELL_BLOCK(bytes) ((((bytes) + 63) / 64) * 64)
/* x's codes (count floats) on the grid of its own min and max, per_batch_qparams's values (its float32 steps): the
 * codes into xq, the scale and zero point out. Returns 1 (nothing written) where x holds inf or NaN. */
static int32_t quantize_own_range(const float *x, int64_t count, int32_t qmin, int32_t qmax, uint8_t *xq, float *scale_out,
                                  int32_t *zp_out) {
    float lo = INFINITY, hi = -INFINITY;
    uint32_t nonfinite = 0;
    for (int64_t i = 0; i < count; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
        nonfinite |= !isfinite(x[i]);
    }
    if (nonfinite) return 1;
    const double min_neg = lo < 0.0f ? lo : 0.0, max_pos = hi > 0.0f ? hi : 0.0;
    float scale = (float)((double)(float)(max_pos - min_neg) / (double)(qmax - qmin));
    scale = scale > 1e-8f ? scale : 1e-8f;
    int32_t zp = qmin - (int32_t)rint((double)(float)(min_neg / (double)scale));
    zp = zp < qmin ? qmin : zp > qmax ? qmax : zp;
    const float inv = (float)(1.0 / (double)scale), q_lo = (float)(qmin - zp), q_hi = (float)(qmax - zp);
    for (int64_t i = 0; i < count; i++) xq[i] = (uint8_t)REQUANTIZE(x[i] * inv, q_lo, q_hi, zp);
    *scale_out = scale;
    *zp_out = zp;
    return 0;
}

/* A dynamic linear (lucid_fx/kernels/dynamic_linear.py): out = x @ W^T + bias of float32 rows x (m x k), x quantized
 * to uint8 on its own range, W's packed int8 codes (n x k, row_sums its per-row code sums) with per-row w_scale, float32
 * out (m x n). g: m, k, n, qmin, qmax. work: m * k codes, then 4 * n bytes of offsets (64-byte aligned). Returns 0, or 1
 * (nothing written) where x holds inf or NaN. */
int32_t lucid_linear_dynamic_float32(const float *x, const int8_t *packed, const int32_t *row_sums, const float *w_scale,
                                     const float *bias, float *out, uint8_t *work, const int64_t *g) {
    const int64_t m = g[0], k = g[1], n = g[2];
    int32_t *offset = (int32_t *)(work + CELL_BLOCK(m * k)), zp;
    float scale;
    if (quantize_own_range(x, m * k, (int32_t)g[3], (int32_t)g[4], work, &scale, &zp)) return 1;
    for (int64_t j = 0; j < n; j++) offset[j] = row_sums[j] * -zp;
    lucid_gemm_float32(work, packed, out, m, n, k, offset, w_scale, bias, scale, 0.0f, 0, -INFINITY, INFINITY, 0);
    return 0;
}

/* One call of a cell (DynamicQuantizedLSTMCell / GRUCell): what recurrent.input_gates and run_layer do for it
 * in Python, in one call. x (batch x inputs) is quantized to uint8 codes [qmin, qmax] on its own min and max
 * with qparams.per_batch_qparams's float32 steps (each computed in double, rounded once to float), its gates
 * by the GEMM with W_ih (offsets -zp * row sums), then one step on the state's grid, recurrent.state_grid's:
 * max(1, |h|) in 127 steps a side. h and c (NULL for a GRU) are updated in place. g: batch, inputs, hidden,
 * cell, qmin, qmax. work: recurrent._cell_work(batch, inputs, hidden, gates) bytes, carved below in blocks
 * of 64. Returns 0; 2 (nothing written) where the state holds inf or NaN, else 1 where x does. */
int32_t lucid_cell_float32(const float *x, const int8_t *ih_packed, const int32_t *ih_row_sums, const float *ih_scale,
                           const float *ih_bias, const int8_t *hh_packed, const int32_t *hh_offset, const float *hh_scale,
                           const float *hh_bias, float *h, float *c, uint8_t *work, const int64_t *g) {
    const int64_t batch = g[0], inputs = g[1], hidden = g[2], cell = g[3], gates = GATES(cell) * hidden;
    const int32_t qmin = (int32_t)g[4], qmax = (int32_t)g[5];
    float h_scale, h_inv, scale;
    int32_t zp;
    uint32_t nonfinite = 0;
    for (int64_t i = 0; i < batch * hidden; i++) nonfinite |= !isfinite(h[i]) || (c != NULL && !isfinite(c[i]));
    if (nonfinite) return 2;
    float *gx = (float *)work, *gh = (float *)(work + CELL_BLOCK(4 * batch * gates)), *out = gh + CELL_BLOCK(4 * batch * gates) / 4;
    int32_t *offset = (int32_t *)(out + CELL_BLOCK(4 * batch * hidden) / 4);
    uint8_t *xq = (uint8_t *)(offset + CELL_BLOCK(4 * gates) / 4), *hq = xq + CELL_BLOCK(batch * inputs);
    if (quantize_own_range(x, batch * inputs, qmin, qmax, xq, &scale, &zp)) return 1;
    for (int64_t j = 0; j < gates; j++) offset[j] = ih_row_sums[j] * -zp;
    lucid_gemm_float32(xq, ih_packed, gx, batch, gates, inputs, offset, ih_scale, ih_bias, scale, 0.0f, 0, -INFINITY,
                       INFINITY, 0);
    grid_of(largest_of(h, batch * hidden), 1.0f, &h_scale, &h_inv);
    step(gx, gates, hh_packed, hh_offset, hh_scale, hh_bias, h, c, out, hidden, hq, gh, batch, hidden, hidden, cell, h_scale,
         h_inv, NULL);
    return 0;
}
