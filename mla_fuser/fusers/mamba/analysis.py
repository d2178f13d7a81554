"""The structural analysis of a traced Mamba mixer: which node and parameter plays which role (``Analysis``).

How a mixer is recognised (never by class, attribute or parameter names):

* The roles come from the arguments of two kernel calls (opaque nodes of the trace, ``trace.py``) whose
  contract is ``mamba_ssm``'s: the causal conv ``(x, weight, bias, activation=)`` and the scan
  ``(x, dt, A, B, C, D=, z=, delta_bias= | dt_bias=, ...)``.
* The conv call is the one whose weight is read from a depthwise ``nn.Conv1d`` child; the scan call is the
  one whose ``A`` is ``-exp(P)`` of a parameter ``P`` of the mixer (that is ``A_log``).  ``P [I, N]`` and a
  3-D channel-first ``x`` make Mamba-1, ``P [H]`` and ``x [B, L, H, P]`` make Mamba-2.
* Every other role follows from data flow into those calls: the input projection is the linear on the
  hidden states whose output pieces feed the conv (and the gate, and Mamba-2's ``dt``); Mamba-1's ``x_proj``
  is the linear on the conv output whose pieces become ``dt`` / ``B`` / ``C`` (optionally through RMSNorms,
  weighted as in Jamba or parameter-free as in Falcon-Mamba), ``dt_proj`` the linear whose weight multiplies
  the ``dt`` piece; Mamba-2's gated RMSNorm is the module called on (scan output, gate); ``D``/``dt_bias``
  are the parameters passed as such; the output projection is the linear feeding the output.  Piece order
  and widths are read from the splits, heads/groups/state size from the shapes at the scan call.
* The trace runs with an all-ones padding mask, so the two places where the mixer zeroes padded positions
  (before the input projection, after the conv) are seen and reproduced.
* Anything left over declines the match, with the reason: an operation on the way to the output that is not
  a shape op or one of the roles, an extra kernel call, a parameter or child with parameters that plays no
  role.  (The probe against the original forward comes after, in ``match.py``.)

The biggest single concern of the package, so it has its own module; it only reads the graph and builds a
``MambaMatch``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

from ... import graph as g
from ...fx_ops import computes_rmsnorm, op_name
from ..base import NoMatch
from .specs import MambaMatch
from .trace import depthwise_conv, entry_signature, kernel_entries


def _is_split(node) -> bool:
    return isinstance(node, fx.Node) and op_name(node) in ("split", "chunk")


def _whole_first_piece(node) -> bool:
    """``torch.tensor_split(x, ...)[0]`` that is all of ``x`` (the same shape)."""
    if not (node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0
            and isinstance(node.args[0], fx.Node) and op_name(node.args[0]) == "tensor_split"):
        return False
    whole, piece = g.meta_val(node.args[0].args[0]), g.meta_val(node)
    return isinstance(whole, torch.Tensor) and isinstance(piece, torch.Tensor) and whole.shape == piece.shape


class Analysis:
    """Roles of one traced mixer; every node the walks pass is recorded as accounted for."""

    def __init__(self, traced: g.TracedModule, mask_arg: str | None, cache_arg: str):
        self.t = traced
        self.module = traced.module
        self.mask_arg = mask_arg
        self.cache_arg = cache_arg
        self.seen: set[fx.Node] = set()
        self.mask_muls: dict[fx.Node, fx.Node] = {}  # mul node -> its data operand

    # -- walking ------------------------------------------------------------------------------------------

    def walk(self, node):
        """Back through shape ops and mask multiplies to the producer: ``(producer, piece)``, where piece is
        ``(split node, index)`` of the first split passed, or None."""
        piece = None
        while isinstance(node, fx.Node):
            self.seen.add(node)
            if node in self.mask_muls:
                node = self.mask_muls[node]
            elif node.op == "call_function" and node.target is operator.getitem and _is_split(node.args[0]):
                if piece is None:
                    piece = (node.args[0], node.args[1])
                node = node.args[0]
            elif _whole_first_piece(node):  # Transformers 5.25's scans split off their last tokens: here none
                self.seen.add(node.args[0])
                node = node.args[0].args[0]
            elif g.is_shape_op(node):
                node = node.args[0]
            elif op_name(node) == "cat" and isinstance(node.args[0], (list, tuple)) and len(node.args[0]) == 1:
                node = node.args[0][0]  # (the same: a join of one piece)
            else:
                break
        return node, piece

    def submodule(self, node) -> nn.Module | None:
        return self.t.submodule(node) if isinstance(node, fx.Node) else None

    def param_of(self, node) -> str:
        """The mixer parameter an argument is (through shape ops / casts), as a dotted name."""
        src, _ = self.walk(node)
        if not (isinstance(src, fx.Node) and src.op == "get_attr"):
            raise NoMatch(f"{node} is not a parameter of the mixer")
        return src.target

    def a_log_of(self, node) -> str | None:
        """``P`` when ``node`` is ``-exp(P)`` for a parameter ``P`` of the mixer itself."""
        neg, _ = self.walk(node)
        if not (isinstance(neg, fx.Node) and op_name(neg) == "neg"):
            return None
        exp, _ = self.walk(neg.args[0])
        if not (isinstance(exp, fx.Node) and op_name(exp) == "exp"):
            return None
        src, _ = self.walk(exp.args[0])
        if src.op != "get_attr" or "." in src.target:
            return None
        self.seen.update((neg, exp))
        return src.target

    def pieces(self, split: fx.Node, width: int) -> tuple[int, ...]:
        """Widths of a split's pieces along its axis, which must be the feature axis of size ``width``."""
        src, out = g.meta_val(split.args[0]), g.meta_val(split)
        dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
        if not isinstance(src, torch.Tensor) or not isinstance(out, (tuple, list)) or src.shape[dim] != width:
            raise NoMatch(f"{split.name} does not split the {width} projected features")
        return tuple(int(piece.shape[dim]) for piece in out)

    # -- the analysis ---------------------------------------------------------------------------------------

    def run(self) -> MambaMatch:
        t, sub = self.t, self.submodule
        for target, nodes in t.nodes_by_module.items():
            if len(nodes) > 1:
                raise NoMatch(f"submodule {target!r} is called {len(nodes)} times")
        self.find_mask_muls()
        calls = [n for n in t.graph.nodes if n.op == "call_function" and n.target in kernel_entries(self.module)]
        convs = [n for n in calls if self.conv_module(n) is not None]
        scans = [n for n in calls if self.a_log_of(_positional(n, 2)) is not None]
        if len(convs) != 1:
            raise NoMatch(f"expected one causal conv call on a depthwise Conv1d weight, found {len(convs)}")
        if len(scans) != 1:
            raise NoMatch(f"expected one selective-scan call with A = -exp(parameter), found {len(scans)}")
        others = [n for n in calls if n not in convs + scans]
        if others:
            raise NoMatch(f"unaccounted kernel call(s): {[n.name for n in others]}")
        conv, scan = convs[0], scans[0]
        self.seen.update((conv, scan))
        a_log = self.a_log_of(_positional(scan, 2))
        conv_mod = self.conv_module(conv)
        conv_args = entry_signature(conv.target).bind(*conv.args, **conv.kwargs)
        activation = conv_args.arguments.get("activation")
        if activation not in (None, "silu", "swish"):
            raise NoMatch(f"conv activation {activation!r} is not SiLU")
        channels, width = conv_mod.weight.shape[0], conv_mod.weight.shape[-1]
        conv_in = g.meta_val(_positional(conv, 0))
        if not isinstance(conv_in, torch.Tensor) or conv_in.ndim != 3 or conv_in.shape[1] != channels:
            raise NoMatch("the conv input is not channel-first [batch, channels, seq]")

        # the input projection: the linear on the hidden states whose piece feeds the conv
        in_node, in_piece = self.walk(_positional(conv, 0))
        if not (g.is_linear(sub(in_node)) and in_piece is not None):
            raise NoMatch(f"the conv input is not a piece of a linear projection (it comes from {in_node.name!r})")
        if self.walk(in_node.args[0])[0] is not t.hidden:
            raise NoMatch("the projection feeding the conv does not take the hidden states")
        in_split = self.pieces(in_piece[0], sub(in_node).out_features)

        scan_args = _bound(scan)
        common = dict(in_proj=in_node.target, conv1d=self.conv_name(conv), a_log=a_log, in_split=in_split,
                      x_piece=in_piece[1], conv_width=int(width), activation=activation,
                      dt_softplus=bool(scan_args.get("delta_softplus", scan_args.get("dt_softplus", False))),
                      mask_arg=self.mask_arg if self.mask_muls else None, cache_arg=self.cache_arg,
                      mask_input=any(self.walk(d)[0] is t.hidden for d in self.mask_muls.values()),
                      mask_conv=any(self.walk(d)[0] is conv for d in self.mask_muls.values()))
        a_shape = tuple(self.module.get_parameter(a_log).shape)
        x_rank = getattr(g.meta_val(_positional(scan, 0)), "ndim", None)
        if len(a_shape) == 2 and x_rank == 3:
            match = self.mamba1(scan, scan_args, conv, in_node, in_piece[0], common, a_shape)
        elif len(a_shape) == 1 and x_rank == 4:
            match = self.mamba2(scan, scan_args, conv, in_node, in_piece[0], common, a_shape)
        else:
            raise NoMatch(f"A_log of shape {list(a_shape)} with a {x_rank}-D scan input is "
                          "neither Mamba-1 ([I, N], channel-first) nor Mamba-2 ([H], [B, L, H, P])")
        if self.mask_muls and not (match.mask_input and match.mask_conv):
            raise NoMatch("the padding mask is applied elsewhere than before the input projection and after the conv")
        self.account(match)
        return match

    def find_mask_muls(self):
        """Multiplications by ``mask[:, :, None]``; the mask must be used for nothing else."""
        mask = next((n for n in self.t.graph.nodes if n.op == "placeholder" and n.target == self.mask_arg), None)
        if mask is None or not mask.users:
            return
        for user in list(mask.users):
            self.seen.add(user)
            muls = [u for u in user.users if op_name(u) == "mul" and len(u.args) == 2]
            if not (user.target is operator.getitem and muls and len(muls) == len(user.users)):
                raise NoMatch(f"the padding mask is used in an unrecognised way ({user.format_node()})")
            for mul in muls:
                self.mask_muls[mul] = mul.args[0] if mul.args[1] is user else mul.args[1]

    def conv_module(self, call: fx.Node) -> nn.Module | None:
        name = self.conv_name(call)
        return self.module.get_submodule(name) if name is not None else None

    def conv_name(self, call: fx.Node) -> str | None:
        src, _ = self.walk(_positional(call, 1))
        if not (isinstance(src, fx.Node) and src.op == "get_attr" and src.target.endswith(".weight")):
            return None
        owner = src.target[: -len(".weight")]
        return owner if depthwise_conv(self.module.get_submodule(owner)) else None

    def norm_of(self, node):
        """``(norm name or None, producer, piece)`` for an argument that may pass one RMSNorm module."""
        src, piece = self.walk(node)
        mod = self.submodule(src)
        if mod is None or g.is_linear(mod):
            return None, src, piece
        if len(src.args) != 1 or src.kwargs:
            raise NoMatch(f"module {src.target!r} on the way to the scan takes more than one input")
        piece_width = g.meta_val(src.args[0]).shape[-1]
        if not _is_rmsnorm(mod, piece_width):
            raise NoMatch(f"module {src.target!r} on the way to the scan is not an RMSNorm")
        inner, piece = self.walk(src.args[0])
        return src.target, inner, piece

    def mamba1(self, scan, args, conv, in_node, in_split_node, common, a_shape) -> MambaMatch:
        sub = self.submodule
        inner, state = a_shape
        x, dt, B, C = (_positional(scan, i) for i in (0, 1, 3, 4))
        if self.walk(x)[0] is not conv:
            raise NoMatch("the scan input is not the conv output")
        z_src, z_piece = self.walk(args.get("z"))
        if z_src is not in_node or z_piece is None or z_piece[0] is not in_split_node:
            raise NoMatch("the scan gate z is not a piece of the input projection")
        # dt = W_dt @ piece: W_dt the weight of a linear child (its bias goes into the scan as delta_bias)
        matmul, _ = self.walk(dt)
        if not (isinstance(matmul, fx.Node) and op_name(matmul) == "matmul"):
            raise NoMatch("dt reaches the scan other than as dt_proj.weight @ piece")
        self.seen.add(matmul)
        w = self.param_of(matmul.args[0])
        dt_proj = w[: -len(".weight")] if w.endswith(".weight") else None
        if dt_proj is None or not g.is_linear(self.module.get_submodule(dt_proj)):
            raise NoMatch("dt is not projected by a linear child's weight")
        dt_norm, xp, dt_piece = self.norm_of(matmul.args[1])
        b_norm, xp_b, b_piece = self.norm_of(B)
        c_norm, xp_c, c_piece = self.norm_of(C)
        if not (g.is_linear(sub(xp)) and xp is xp_b is xp_c and None not in (dt_piece, b_piece, c_piece)):
            raise NoMatch("dt, B and C are not pieces of one linear projection")
        if self.walk(xp.args[0])[0] is not conv:
            raise NoMatch("the dt/B/C projection does not take the conv output")
        x_split = self.pieces(dt_piece[0], sub(xp).out_features)
        bias = args.get("delta_bias")
        if bias is not None and self.param_of(bias) != f"{dt_proj}.bias":
            raise NoMatch("delta_bias is not the dt projection's bias")
        if bias is None and self.module.get_submodule(dt_proj).bias is not None:
            raise NoMatch("the dt projection's bias is not used as delta_bias")
        d = self.param_of(args["D"]) if args.get("D") is not None else None
        dt_rank = x_split[dt_piece[1]]
        in_split = common["in_split"]
        if (x_split[b_piece[1]], x_split[c_piece[1]]) != (state, state) or in_split[z_piece[1]] != inner:
            raise NoMatch(f"B/C widths {x_split} or input pieces {in_split} disagree with A_log [{inner}, {state}]")
        return MambaMatch(kind="mamba1", out_proj=self.out_proj(scan), d=d, z_piece=z_piece[1], dt_piece=None,
                          x_split=x_split, pieces=(dt_piece[1], b_piece[1], c_piece[1]), intermediate_size=inner,
                          state_size=state, x_proj=xp.target, dt_proj=dt_proj, dt_norm=dt_norm, b_norm=b_norm,
                          c_norm=c_norm, dt_rank=dt_rank, dt_proj_bias=bias is not None, **common)

    def mamba2(self, scan, args, conv, in_node, in_split_node, common, a_shape) -> MambaMatch:
        sub = self.submodule
        x, dt, B, C = (_positional(scan, i) for i in (0, 1, 3, 4))
        if args.get("z") is not None:
            raise NoMatch("the gate is applied inside the scan (no gated RMSNorm after it)")
        if args.get("initial_states") is not None:
            raise NoMatch("the scan starts from a state without a cache")
        pieces = [self.walk(v) for v in (x, B, C)]
        if any(src is not conv or piece is None for src, piece in pieces) or len({p[0] for _, p in pieces}) != 1:
            raise NoMatch("x, B and C are not pieces of the conv output")
        split = pieces[0][1][0]
        x_split = self.pieces(split, self.conv_module(conv).weight.shape[0])
        dt_src, dt_piece = self.walk(dt)
        if dt_src is not in_node or dt_piece is None or dt_piece[0] is not in_split_node:
            raise NoMatch("dt is not a piece of the input projection")
        heads = a_shape[0]
        _, _, x_heads, head_dim = g.meta_val(x).shape
        _, _, groups, state = g.meta_val(B).shape
        if x_heads != heads or tuple(g.meta_val(C).shape[2:]) != (groups, state) or heads % groups:
            raise NoMatch(f"heads {x_heads} / groups {groups} at the scan disagree with A_log [{heads}]")
        d = self.param_of(args["D"]) if args.get("D") is not None else None
        dt_bias = self.param_of(args["dt_bias"]) if args.get("dt_bias") is not None else None
        limit = tuple(float(v) for v in args.get("dt_limit", (0.0, float("inf"))))
        # y = norm(scan output, gate), then the output projection
        out_proj = self.out_proj_node()
        norm, _ = self.walk(out_proj.args[0])
        if sub(norm) is None or len(norm.args) != 2 or norm.kwargs:
            raise NoMatch("the output projection is not fed by a gated norm(y, gate)")
        if self.walk(norm.args[0])[0] is not scan:
            raise NoMatch("the gated norm does not normalise the scan output")
        z_src, z_piece = self.walk(norm.args[1])
        if z_src is not in_node or z_piece is None or z_piece[0] is not in_split_node:
            raise NoMatch("the norm's gate is not a piece of the input projection")
        self.seen.add(norm)
        return MambaMatch(kind="mamba2", out_proj=out_proj.target, d=d, z_piece=z_piece[1], dt_piece=dt_piece[1],
                          x_split=x_split, pieces=(pieces[0][1][1], pieces[1][1][1], pieces[2][1][1]),
                          intermediate_size=heads * head_dim, state_size=int(state), dt_bias=dt_bias, norm=norm.target,
                          num_heads=heads, head_dim=int(head_dim), n_groups=int(groups), dt_limit=limit, **common)

    def out_proj_node(self) -> fx.Node:
        node = g.linear_feeding_output(self.t)
        if node is None:
            raise NoMatch("no single output projection feeds the output")
        return node  # that nothing follows it is checked by ``account``

    def out_proj(self, scan) -> str:
        node = self.out_proj_node()
        if self.walk(node.args[0])[0] is not scan:
            raise NoMatch("the output projection does not take the scan output")
        return node.target

    def account(self, match: MambaMatch) -> None:
        """Decline anything on the way to the output, or any parameter, that plays no role."""
        t = self.t
        needed, frontier = set(), [t.output]
        while frontier:
            node = frontier.pop()
            if node not in needed:
                needed.add(node)
                frontier.extend(node.all_input_nodes)
        roles = {match.in_proj, match.out_proj, match.x_proj, match.dt_norm, match.b_norm, match.c_norm, match.norm}
        for node in t.graph.nodes:
            if node not in needed or node.op in ("placeholder", "output") or node in self.seen or g.is_shape_op(node):
                continue
            if node.op == "call_module" and node.target in roles:
                continue
            if node.op == "call_function" and op_name(node) == "_assert_is_none":
                continue  # fx's guard on an argument specialised to None
            raise NoMatch(f"unaccounted operation on the way to the output: {node.format_node()}")
        params = {match.a_log, match.d, match.dt_bias} - {None}
        extra = [n for n, _ in self.module.named_parameters(recurse=False) if n not in params]
        if extra:
            raise NoMatch(f"unaccounted parameter(s): {extra}")
        owners = roles | {match.conv1d, match.dt_proj}
        for name, child in self.module.named_children():
            if name not in owners and (any(True for _ in child.parameters()) or any(True for _ in child.buffers())):
                raise NoMatch(f"unaccounted submodule {name!r} ({type(child).__name__})")


def _positional(call: fx.Node, index: int):
    """The argument bound to the call's ``index``-th parameter (passed by position or keyword), or None."""
    params = list(entry_signature(call.target).parameters.values())
    if index < len(call.args):
        return call.args[index]
    return call.kwargs.get(params[index].name) if index < len(params) else None


def _bound(call: fx.Node) -> dict:
    """Every argument of the call by parameter name, defaults filled in, ``**kwargs`` flattened."""
    signature = entry_signature(call.target)
    bound = signature.bind(*call.args, **call.kwargs)
    bound.apply_defaults()
    args = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind == param.VAR_KEYWORD:
            args.update(args.pop(name, {}))
    return args


def _is_rmsnorm(module: nn.Module, width: int) -> bool:
    """RMSNorm by computation: weighted (``graph.rmsnorm_width``) or parameter-free (Falcon-Mamba's)."""
    if g.rmsnorm_width(module) == width:
        return True
    if any(True for _ in module.parameters()) or any(True for _ in module.children()):
        return False
    try:
        traced = g.trace_module(module, width)
    except g.TraceError:
        return False
    return computes_rmsnorm(traced.graph, weighted=False)
