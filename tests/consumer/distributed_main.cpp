// A program that uses the installed attn::distributed as a project that
// depends on it would: its headers, its target. It runs as the one rank of
// a group on the loopback (the variables torchrun would set, with a port
// the system picks), so that ctest needs no launcher.
//
//   consumer <expected attn version>
//
// Exit code 0 when the headers carry that version and the one-rank
// tensor-parallel module computes what its whole module computes.

#include <attn/attn.h>
#include <attn/distributed/tensor_parallel_multi_head_attention.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>

namespace {

// A loopback port that was free a moment ago.
int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  const bool bound = fd >= 0 &&
      bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  if (fd >= 0) {
    close(fd);
  }
  return bound ? ntohs(address.sin_port) : -1;
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: consumer <expected attn version>\n";
    return 2;
  }
  if (std::string(ATTN_VERSION) != argv[1]) {
    std::cerr << "headers say attn " << ATTN_VERSION << ", expected " << argv[1] << "\n";
    return 1;
  }
  const int port = free_port();
  if (port < 0) {
    std::cerr << "no free loopback port\n";
    return 1;
  }
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  const auto group = attn::distributed::init_process_group();

  attn::MultiHeadAttention whole(attn::MultiHeadAttentionOptions(16, 4));
  attn::distributed::TensorParallelMultiHeadAttention parallel(whole, group);
  const auto x = torch::randn({2, 5, 16}); // (B, T, E)
  const auto expected = std::get<0>(whole(x, x, x));
  const auto actual = std::get<0>(parallel(x, x, x));
  const bool same = torch::allclose(actual, expected, 1e-5, 1e-6);
  std::cout << "attn " << ATTN_VERSION << ": " << group.size() << " rank, output "
            << actual.sizes() << (same ? ", as the whole module's" : ", NOT the whole module's")
            << "\n";
  return same ? 0 : 1;
}
