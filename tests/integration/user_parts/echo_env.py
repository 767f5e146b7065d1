"""An environment that forgets to return its answer: step() returns None."""


class SilentEcho:
    tools = ("echo",)

    def reset(self, prompt):
        self.prompt = prompt

    def step(self, action):
        self.last = action
