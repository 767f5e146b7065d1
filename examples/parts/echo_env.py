"""An environment from outside the package: one ``echo`` tool that answers its argument."""

from rlpost.envs.base import StepResult


class Echo:
    tools = ("echo",)

    def reset(self, prompt):
        self.prompt = prompt

    def step(self, action):
        if action.call is None:  # the policy answered
            return StepResult(done=True)
        return StepResult(observation=action.call.arguments)
