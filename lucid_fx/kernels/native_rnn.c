/* Recurrent layers whose hidden-to-hidden products run in int8 (lucid_fx/kernels/recurrent.py), compiled
 * with native.c (see there): the whole sequence of one layer and direction in one call.
 *
 * Each step quantizes the hidden state's active rows to uint8 on the grid the caller fixed (h_scale,
 * h_zp: an LSTM's and a GRU's state lies in [-1, 1] when it starts there), multiplies them with the packed
 * int8 weight in native_gemm.c's GEMM into float gates (w_scale per output, bias_hh added), adds the
 * input's gates gx (x @ W_ih^T + b_ih, computed for every step at once by the caller) and runs the cell
 * in float32, torch's formulas in torch's order:
 *
 *   LSTM (gates i, f, g, o): c' = f * c + i * g,  h' = o * tanh(c')
 *   GRU  (gates r, z, n):    n = tanh(gx_n + r * gh_n),  h' = (h - n) * z + n
 *
 * sigmoid and tanh are native_math.h's, within 2e-7 of torch's, so the codes of the next step's state match
 * torch's route (recurrent.py's) except where a value lies that close to a rounding tie.
 *
 * g holds steps, batch, hidden, cell (0 LSTM, 1 GRU), reverse, gx's and out's row strides (floats), then
 * steps + 1 row offsets: step t reads rows rows[t] .. rows[t + 1] - 1 of gx and writes those of out, and
 * its rows are the state's first rows[t + 1] - rows[t] (a packed sequence's batch shrinks with time; the
 * state's other rows keep their values). h and c (NULL for a GRU) are (batch, hidden), updated in place;
 * hq (batch x hidden codes) and gh (batch x gates x hidden floats) are scratch. */
#include <math.h>
#include <stdint.h>

#include "native_codes.h" /* REQUANTIZE */
#include "native_math.h"  /* sigmoid_exp, tanh_exp */

void lucid_gemm_float32(const uint8_t *x, const int8_t *packed, float *out, int64_t m, int64_t n, int64_t k,
                        const int32_t *offset, const float *w_scale, const float *bias, float x_scale,
                        float inv_out, int32_t zp, float low, float high, int32_t hardswish);

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

void lucid_rnn_float32(const float *gx, const int8_t *packed, const int32_t *offset, const float *w_scale,
                       const float *bias, float *h, float *c, float *out, uint8_t *hq, float *gh,
                       const int64_t *g, float h_scale, float h_inv) {
    const int64_t steps = g[0], hidden = g[2], cell = g[3], reverse = g[4], gx_stride = g[5], out_stride = g[6];
    const int64_t *rows = g + 7, gates = (cell == 0 ? 4 : 3) * hidden;
    const float inv = h_inv, zp = 128.0f; /* h_inv: 1 / h_scale rounded as the torch route rounds it */
    for (int64_t s = 0; s < steps; s++) {
        const int64_t t = reverse ? steps - 1 - s : s, first = rows[t], batch = rows[t + 1] - rows[t];
        for (int64_t i = 0; i < batch * hidden; i++) hq[i] = (uint8_t)REQUANTIZE(h[i] * inv, -zp, 255.0f - zp, 128);
        lucid_gemm_float32(hq, packed, gh, batch, gates, hidden, offset, w_scale, bias, h_scale, 0.0f, 0, -INFINITY,
                           INFINITY, 0);
        for (int64_t r = 0; r < batch; r++) {
            const float *x = gx + (first + r) * gx_stride;
            float *o = out + (first + r) * out_stride;
            if (cell == 0) lstm_cell(gh + r * gates, x, h + r * hidden, c + r * hidden, o, hidden);
            else gru_cell(gh + r * gates, x, h + r * hidden, o, hidden);
        }
    }
}
