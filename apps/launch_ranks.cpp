// attn_launch_ranks <world size> <timeout seconds> <program> [arguments...]
//
// Runs <program> as the W ranks of a process group on this machine, the
// way torchrun does: each with RANK, LOCAL_RANK, WORLD_SIZE, and
// MASTER_ADDR=127.0.0.1 with a free MASTER_PORT for the rendezvous. Waits
// for all of them at most the timeout; a rank still running then is
// killed, with its process group, and so is every rank when the launcher
// is interrupted (SIGINT, SIGTERM). Exits 0 when every rank exited 0, 1
// when one failed, 2 with one line on stderr for bad arguments.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <sys/wait.h>
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace {

constexpr int kMaxWorldSize = 1024;

volatile std::sig_atomic_t interrupted = 0;

void on_interrupt(int /*signal*/) {
  interrupted = 1;
}

// `text` as an integer in [1, max]; exits 2 naming `what` otherwise.
int positive_argument(const char* text, const char* what, int max) {
  int value = 0;
  const std::string_view view(text);
  const auto [end, error] = std::from_chars(view.data(), view.data() + view.size(), value);
  if (error != std::errc() || end != view.data() + view.size() || value < 1 || value > max) {
    std::fprintf(
        stderr, "attn_launch_ranks: %s: expected an integer from 1 to %d, got '%s'\n", what, max,
        text);
    std::exit(2);
  }
  return value;
}

// A port that was free a moment ago on the loopback: the rank 0 store
// binds it right after, so another process taking it in between is
// unlikely (and would fail the run with a bind error, not hang it).
int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    std::perror("attn_launch_ranks: finding a free port");
    std::exit(2);
  }
  close(fd);
  return ntohs(address.sin_port);
}

// The rank's process, or -1 where it could not be made. Each rank leads its
// own process group, so that a kill reaches its children, and dies with
// the launcher.
pid_t start_rank(int rank, int world_size, int port, char** program) {
  const pid_t pid = fork();
  if (pid < 0) {
    std::perror("attn_launch_ranks: fork");
    return -1;
  }
  if (pid == 0) {
    setpgid(0, 0);
#ifdef __linux__
    prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
    setenv("RANK", std::to_string(rank).c_str(), 1);
    setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
    setenv("WORLD_SIZE", std::to_string(world_size).c_str(), 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    execvp(program[0], program); // a program on PATH too, as torchrun finds it
    std::perror("attn_launch_ranks: exec");
    std::_Exit(127);
  }
  setpgid(pid, pid); // also here: a kill may come before the child ran
  return pid;
}

void kill_rank(pid_t pid) {
  if (kill(-pid, SIGKILL) != 0) {
    kill(pid, SIGKILL);
  }
  waitpid(pid, nullptr, 0);
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(
        stderr,
        "usage: attn_launch_ranks <world size> <timeout seconds> <program> [arguments...]\n");
    return 2;
  }
  const int world_size = positive_argument(argv[1], "world size", kMaxWorldSize);
  const int timeout = positive_argument(argv[2], "timeout seconds", 7 * 24 * 3600);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout);
  std::signal(SIGINT, on_interrupt);
  std::signal(SIGTERM, on_interrupt);
  const int port = free_port();
  std::vector<pid_t> ranks;
  ranks.reserve(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    const pid_t pid = start_rank(rank, world_size, port, argv + 3);
    if (pid < 0) {
      for (const pid_t started : ranks) {
        kill_rank(started);
      }
      return 1;
    }
    ranks.push_back(pid);
  }
  int failed = 0, running = world_size;
  while (running > 0 && interrupted == 0 && std::chrono::steady_clock::now() < deadline) {
    for (int rank = 0; rank < world_size; ++rank) {
      int status = 0;
      if (ranks[rank] > 0 && waitpid(ranks[rank], &status, WNOHANG) == ranks[rank]) {
        ranks[rank] = 0;
        --running;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
          std::fprintf(stderr, "attn_launch_ranks: rank %d failed (status %d)\n", rank, status);
          ++failed;
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int rank = 0; rank < world_size; ++rank) {
    if (ranks[rank] > 0) {
      std::fprintf(
          stderr, "attn_launch_ranks: rank %d still running %s: killed\n", rank,
          interrupted != 0 ? "when interrupted" : "at the timeout");
      kill_rank(ranks[rank]);
      ++failed;
    }
  }
  return failed == 0 ? 0 : 1;
}
