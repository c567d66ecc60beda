"""decompose_einsum: a two-operand einsum that is a matrix product becomes permute -> reshape -> matmul ->
reshape -> permute, and its matmul an int8 one; anything else stays one float call."""

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx.kernels.library import op_name
from lucid_fx.passes.decompose_einsum import matmul_plan

PRODUCTS = [  # equation, a's shape, b's shape
    ("bhqd,bhkd->bhqk", (2, 3, 4, 5), (2, 3, 6, 5)),  # attention's scores
    ("bhqk,bkhd->bqhd", (2, 3, 4, 6), (2, 6, 3, 5)),  # its output, heads last but one
    ("ij,jk->ik", (3, 4), (4, 5)), ("bij,bjk->bik", (2, 3, 4), (2, 4, 5)), ("bnd,dh->bnh", (2, 3, 4), (4, 5)),
    ("...qd,...kd->...qk", (2, 3, 4, 5), (2, 3, 6, 5)), ("...qd,kd->...qk", (2, 3, 4, 5), (6, 5)),
    ("i,j->ij", (3,), (4,)), ("bqd,bkd->bkq", (2, 3, 4), (2, 5, 4)), ("abcd,cdef->abef", (2, 3, 4, 5), (4, 5, 6, 7)),
    ("bi,bi->b", (3, 4), (3, 4)), ("ij,ik->jk", (3, 4), (3, 5)), (" b h q d , b h k d -> b h q k ", (1, 2, 3, 4), (1, 2, 5, 4)),
]


def _planned(equation, a, b):
    (perm_a, view_a, perm_b, view_b, view_out, perm_out), _, _ = matmul_plan(equation, a.shape, b.shape)
    return (a.permute(perm_a).reshape(view_a) @ b.permute(perm_b).reshape(view_b)).reshape(view_out).permute(perm_out)


@pytest.mark.parametrize("equation,a,b", PRODUCTS)
def test_the_plan_computes_the_einsum(equation, a, b):
    x, y = torch.randn(a), torch.randn(b)
    torch.testing.assert_close(_planned(equation, x, y), torch.einsum(equation, x, y))


@pytest.mark.parametrize("equation,a,b", [
    ("ii,ij->ij", (3, 3), (3, 4)),  # a letter twice in one operand: a diagonal
    ("ij,jk", (3, 4), (4, 5)),  # no output given
    ("ij,kl->ik", (3, 4), (5, 6)),  # j and l summed in one operand alone
    ("ij,jk->ik", (3, 4), (1, 5)),  # j of sizes 4 and 1: a broadcast
    ("ij,jk,kl->il", (3, 4), (4, 5)),  # three operands
    ("ij,jk->ikz", (3, 4), (4, 5)),  # an output letter in no operand
])
def test_what_is_no_matrix_product_has_no_plan(equation, a, b):
    assert matmul_plan(equation, a, b) is None


class EinsumAttention(nn.Module):  # research code's attention: einsum for the scores and for the weighted values
    def __init__(self, d=64, heads=4):
        super().__init__()
        self.qkv, self.out, self.heads, self.scale = nn.Linear(d, 3 * d), nn.Linear(d, d), heads, (d // heads) ** -0.5

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).unbind(2)
        attention = (torch.einsum("bqhd,bkhd->bhqk", q, k) * self.scale).softmax(-1)
        return self.out(torch.einsum("bhqk,bkhd->bqhd", attention, v).reshape(b, n, d))


def test_einsum_attention_runs_its_products_in_int8(sqnr_db):
    torch.manual_seed(0)
    model, batches = EinsumAttention().eval(), [torch.randn(2, 16, 64) for _ in range(4)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    assert not any(n.target is torch.einsum for n in prepared.graph.nodes)
    lucid_fx.calibrate(prepared, batches, progress=False)
    q = lucid_fx.convert(prepared)
    ops = [op_name(n) for n in q.graph.nodes]
    assert ops.count("matmul") + ops.count("softmax_matmul") == 2 and q.lucid_fx_convert_report.float_ops == {}
    with torch.no_grad():
        x = torch.randn(2, 16, 64)
        assert sqnr_db(model(x), q(x)) >= 30


class OuterProducts(nn.Module):  # three operands: no matrix product, one float call
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 4), nn.Linear(8, 5), nn.Linear(8, 6)

    def forward(self, x):
        return torch.einsum("bi,bj,bk->bijk", self.a(x), self.b(x), self.c(x)).flatten(1)


def test_an_einsum_that_stays_one_call_is_float_and_counted_in_the_report():
    torch.manual_seed(0)
    model, batches = OuterProducts().eval(), [torch.randn(3, 8) for _ in range(2)]
    q = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    report = q.lucid_fx_convert_report
    assert report.flops["einsum"] == 2 * 2 * 3 * 4 * 5 * 6  # two multiplies per (b, i, j, k)
    assert "float op: einsum (no lowering rule for einsum, " in str(report), str(report)
