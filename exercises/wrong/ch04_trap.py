"""Mistakes: the hook scales its argument as if it were the gradient (it is the parameter);
ready_order forgets to remove its hooks."""

from exercises.solutions.chapter04_hooks import assign_buckets  # noqa: F401


def ready_order(model, loss):
    order = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: order.append(name))
    loss.backward()
    return order


def scale_gradients(model, factor):
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda grad: grad.mul_(factor))
