// attn_launch_ranks <world size> <timeout seconds> <program> [arguments...]
//
// Runs <program> as the W ranks of a process group on this machine, the
// way torchrun does: each with RANK, LOCAL_RANK, WORLD_SIZE, and
// MASTER_ADDR=127.0.0.1 with a free MASTER_PORT for the rendezvous. Waits
// for all of them at most the timeout; a rank still running then is
// killed, with its process group. Exits 0 when every rank exited 0.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

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

pid_t start_rank(int rank, int world_size, int port, char** program) {
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0); // its own group, so that a kill reaches its children
    setenv("RANK", std::to_string(rank).c_str(), 1);
    setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
    setenv("WORLD_SIZE", std::to_string(world_size).c_str(), 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    execv(program[0], program);
    std::perror("attn_launch_ranks: exec");
    std::_Exit(127);
  }
  return pid;
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(
        stderr,
        "usage: attn_launch_ranks <world size> <timeout seconds> <program> [arguments...]\n");
    return 2;
  }
  const int world_size = std::atoi(argv[1]);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(std::atoi(argv[2]));
  const int port = free_port();
  std::vector<pid_t> ranks;
  for (int rank = 0; rank < world_size; ++rank) {
    ranks.push_back(start_rank(rank, world_size, port, argv + 3));
  }
  int failed = 0, running = world_size;
  while (running > 0 && std::chrono::steady_clock::now() < deadline) {
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
          stderr, "attn_launch_ranks: rank %d still running at the timeout: killed\n", rank);
      kill(-ranks[rank], SIGKILL);
      waitpid(ranks[rank], nullptr, 0);
      ++failed;
    }
  }
  return failed == 0 ? 0 : 1;
}
