"""The ``node.meta`` keys through which passes talk. Every key lucid_fx writes is named here, and
the names of what prepare adds to a GraphModule beside its graph (observer containers, gm.meta)."""

#: CanonicalCall: the canonical op of a node and its normalised arguments (canonicalize_ops).
OP = "lucid_fx.op"
#: (lo, hi): the proven output interval of a node (analyze_ranges).
INTERVAL = "lucid_fx.interval"
#: str: file:line of the range rule that proved INTERVAL (analyze_ranges).
INTERVAL_RULE = "lucid_fx.interval_rule"
#: str: name of the fusion pattern a node belongs to (fuse_patterns), on every member.
FUSION = "lucid_fx.fusion"
#: str: name of the node that ends the fused group this node belongs to (fuse_patterns).
FUSED_INTO = "lucid_fx.fused_into"
#: Decision: which observer the node's output gets, and the rule that chose it (choose_observers).
DECISION = "lucid_fx.decision"
#: QConfig: of an nn.LSTM, nn.GRU or cell that convert runs as quantize_dynamic's int8 layer (choose_observers;
#: lucid_fx.rules.recurrent); absent where its QConfig is None (the layer stays float).
DYNAMIC = "lucid_fx.dynamic"
#: str: the region kind of an op whose precision quantize(precision="measured") may choose by
#: measurement, int8 or float (choose_observers; lucid_fx.rules.float_policies.MEASURED_OPS).
MEASURED = "lucid_fx.measured"
#: str: qualified name of the module whose forward produced the node (trace_model).
MODULE_PATH = "lucid_fx.module_path"
#: str: name of the observer module that watches this node's output (insert_observers).
OBSERVER = "lucid_fx.observer"
#: torch's own ShapeProp key: TensorMetadata with shape and dtype (propagate_shapes).
TENSOR_META = "tensor_meta"
#: str: key in the root's ``lucid_fx_weight_observers`` of the weight observer a node reads (insert_observers).
WEIGHT_OBSERVER = "lucid_fx.weight_observer"
#: bool: the node's weight absorbed a batch norm at convert, so qparams a QAT weight trained with no longer fit (fold_batchnorm).
BN_FOLDED = "lucid_fx.bn_folded"
#: str: why a batch norm was not folded into the layer before it (so a group ending in it runs in float) (fold_batchnorm).
BN_NOT_FOLDED = "lucid_fx.bn_not_folded"
#: str: why an in-place op, or a view of the value it changes, stays as written and runs in float: the change is seen outside the graph or through another view (functionalize_inplace).
MUTATION = "lucid_fx.mutation"

# Written by convert on the nodes of the converted graph, read by to_networkx and compare:
#: str: name of the prepared-graph node whose value a converted node computes (lower_to_int8).
SOURCE = "lucid_fx.source"
#: (scale, zero_point, grid name): the grid of the integer codes a converted node outputs (lower_to_int8).
QPARAMS = "lucid_fx.qparams"
#: str: the lowering rule key ("conv2d+relu") that produced a converted node (lower_to_int8).
LOWERING = "lucid_fx.lowering"
#: str: class name of the observer that calibrated a converted node's qparams (lower_to_int8).
OBSERVER_KIND = "lucid_fx.observer_kind"
#: (shape, dtype): the shape and dtype a converted node outputs, known at lowering (lower_to_int8).
VALUE_TYPE = "lucid_fx.value_type"
#: Placement: where the prepared node whose value this converted node computes runs (int8 kernel,
#: table lookup, shared codes, float) and why: the lowering rule key or the reason it stayed float (lower_to_int8).
PLACEMENT = "lucid_fx.placement"
#: Dict[str, Placement]: prepared nodes with no value of their own that this converted node's kernel or table
#: computes (a softmax inside softmax_matmul, the ops inside one table: rules/one_source.py), by name (lower_to_int8).
ABSORBED = "lucid_fx.absorbed"

# Written on a program's nodes (lower_to_program), never on the portable graph:
#: BoundCall: the torch operator a bound call runs (``operator.call(self._program_bound_N, x)``) and its arguments,
#: constants as values (bind_program_ops).
BOUND_OP = "lucid_fx.bound_op"

# Written by convert's fold on the prepared graph's nodes:
#: str: name of the batch-norm node folded into this conv/linear, whose value the node now outputs (fold_batchnorm).
FOLDED_BN = "lucid_fx.folded_bn"

# A GraphModule.meta key (``gm.meta``, kept by deepcopy), not a node.meta one:
#: TraceOptions: how prepare traced this graph (leaf modules, concrete_args, leaf functions), so that
#: compare traces the float model the same way (prepare; carried to the converted graph by lower_to_int8).
TRACE = "lucid_fx.trace"
#: Dict[str, str]: the nodes remove_noops took out of the traced graph (no-op casts, eval-mode
#: dropout, identity), by name, and why (remove_noops).
REMOVED = "lucid_fx.removed"
#: int: the matrix FLOPs of what fold_constants computed once at prepare, no longer run per call (pipeline).
FOLDED_FLOPS = "lucid_fx.folded_flops"
#: Dict[str, Any]: plain attributes of the module a nested GraphModule replaced (``stride``), which its
#: parent may read; set again after a deep copy (lucid_fx/_fallback.py, prepare and convert).
ATTRIBUTES = "lucid_fx.attributes"

# Submodules prepare adds to a GraphModule (attributes, not node.meta keys), read by every later verb:
#: nn.ModuleDict: the activation observers (and a functional weight's), by node name (insert_observers).
OBSERVERS = "lucid_fx_observers"
#: nn.ModuleDict: the weight observers of conv/linear modules, by module path (insert_observers).
WEIGHT_OBSERVERS = "lucid_fx_weight_observers"

#: The names above that are not node.meta keys.
NOT_NODE_KEYS = ("TRACE", "REMOVED", "FOLDED_FLOPS", "ATTRIBUTES", "OBSERVERS", "WEIGHT_OBSERVERS")
#: The names above of node.meta keys on programs only: never saved, so a file holding one is refused at load.
PROGRAM_KEYS = ("BOUND_OP",)
